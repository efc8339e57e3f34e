"""Admin routes: attach, re-configure, inspect and detach the L3 storage backend at runtime.

``PUT /hicache/storage-backend`` with ``{"backend", "extra_config",
"prefetch_policy"}`` attaches a backend, or, when the same backend is already
attached, updates its policies. ``DELETE`` detaches (a no-op when nothing is
attached); ``GET`` shows the engine's storage status. Every call needs
``Authorization: Bearer <--admin-api-key>``: without a configured key the
admin API is off (400), a wrong or missing key is a 401. Attaching and
detaching only happen while no request runs (409 otherwise), so no request
ever sees L3 change under it. SGLang's ``/clear_hicache_storage_backend``
(GET or POST) empties the attached store, under the same key and the same
idle rule; L1 and L2 keep their pages. Two of SGLang's routes that act on
every client's requests, ``/flush_cache`` and ``/abort_request`` with
``abort_all``, are open on a server without a key (as in SGLang) and need
this key on a server with one (``authorize_if_keyed``). ``POST /hicache/drain`` (the
same key) starts draining the worker (``server/drain.py``): 202, or 409 when draining.

The ``dynamic`` backend imports the Python module its extra config names and
runs it: through this API that would turn the admin key into a key to run any
code as the server's user. So ``PUT`` refuses it (403) unless the server was
started with ``--admin-allow-dynamic-backend``. An operator who names it at
start-up (``--hicache-storage-backend dynamic``) chose the module themselves
and needs no flag. The directory of a backend that keeps files (``file``,
``nixl``, ``aibrix``) must lie under ``--l3-path-root`` (403 otherwise;
``l3_path_root``). Both hold for a backend wrapped by another (``throttled``'s
``backend`` and ``backend_extra``), at any depth.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from hicache.config import ConfigError
from hicache.server.body import parse_body
from hicache.server.errors import APIError
from hicache.server.l3_path_root import confined_extra_config
from hicache.server.protocol import StorageBackendRequest
from hicache.server.server_info import public_config
from hicache.server.state import ServerState, get_state
from hicache.storage.base import StorageError
from hicache.storage.registry import backend_names

router = APIRouter()

ROUTE = "/hicache/storage-backend"
ADMIN_ALLOW_DYNAMIC_FLAG = "--admin-allow-dynamic-backend"
# Backends that load code named in the request: attached here only behind that flag.
CODE_LOADING_BACKENDS = frozenset({"dynamic"})
_BUSY = "requests are running: change L3 only while the server is idle, then retry"


def authorize(state: ServerState, request: Request) -> None:
    if state.admin_api_key is None:
        raise APIError(400, "the admin API is disabled: start the server with --admin-api-key")
    check_bearer(state.admin_api_key, request)


def authorize_if_keyed(state: ServerState, request: Request) -> None:
    """For routes open to all on a server without a key (SGLang's /flush_cache, /abort_request
    with abort_all) that act on everyone's requests: with ``--admin-api-key`` set they need
    it too (401 otherwise)."""
    if state.admin_api_key is not None:
        check_bearer(state.admin_api_key, request)


def check_bearer(key: str, request: Request) -> None:
    """APIError(401) unless the request carries ``Authorization: Bearer <key>``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = key.encode()
    # Constant-time comparison: the key must not leak through response timing.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise APIError(
            401, "missing or wrong admin key: send 'Authorization: Bearer <admin key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _change_storage(state: ServerState, change: Any, *args: Any) -> None:
    """Run an attach/detach on a worker thread (it waits for the scheduler thread)."""
    if not await run_in_threadpool(state.engine.is_idle):
        raise APIError(409, _BUSY)
    try:
        await run_in_threadpool(change, *args)
    except (StorageError, ConfigError) as error:
        # The engine refuses with a StorageError too when a request slipped in meanwhile.
        status = 400 if await run_in_threadpool(state.engine.is_idle) else 409
        raise APIError(status, str(error)) from None


@router.get(ROUTE)
async def storage_status(request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
    return await run_in_threadpool(state.engine.storage_status)


@router.put(ROUTE)
async def attach_storage(request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
    body = await parse_body(request, StorageBackendRequest)
    name = body.backend.strip().lower()
    if name == "none":
        raise APIError(400, "to turn L3 off, DELETE this resource", param="backend")
    # Checked before anything is created, so the named module is never even imported.
    # A wrapper (``throttled``) of a code-loading backend loads code all the same.
    loader = next((n for n in backend_names(name, body.extra_config)
                   if n in CODE_LOADING_BACKENDS), None)
    if loader is not None and not state.admin_allow_dynamic_backend:
        raise APIError(
            403, f"the {loader!r} backend imports and runs the Python module its extra config "
            f"names, so the admin API attaches it only on a server started with "
            f"{ADMIN_ALLOW_DYNAMIC_FLAG}", param="backend",
        )
    # Files go only under --l3-path-root (403 otherwise), checked before anything is created.
    extra_config = confined_extra_config(name, body.extra_config, state.l3_path_root)
    await _change_storage(
        state, state.engine.attach_storage, body.backend, extra_config, body.prefetch_policy
    )
    state.storage_config = public_config(extra_config)  # for /get_server_info
    return await run_in_threadpool(state.engine.storage_status)


@router.delete(ROUTE)
async def detach_storage(request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
    await _change_storage(state, state.engine.detach_storage)
    return await run_in_threadpool(state.engine.storage_status)


# SGLang's name; GET or POST, with the admin key like the rest of this API: clearing
# a store that other instances share is not for anyone who can reach the port.
CLEAR_ROUTE = "/clear_hicache_storage_backend"


@router.api_route(CLEAR_ROUTE, methods=["GET", "POST"])
async def clear_storage(request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
    await _change_storage(state, state.engine.clear_storage)
    return {"cleared": True, "message": "Hierarchical cache storage backend cleared."}


INTEGRITY_ROUTE = "/hicache/check-integrity"


@router.post(INTEGRITY_ROUTE)
async def check_integrity(request: Request) -> dict[str, Any]:
    """Assert the radix tree and every pool are consistent and no page leaked (an idle
    server only: 409 while requests run, 500 with the broken invariant)."""
    state = get_state(request)
    authorize(state, request)
    engine: Any = state.engine  # the engine API has it, the protocol does not promise it
    if not await run_in_threadpool(engine.is_idle):
        raise APIError(409, "requests are running: check integrity on an idle server")
    try:
        await run_in_threadpool(engine.check_integrity)
    except AssertionError as error:
        raise APIError(500, f"integrity check failed: {error}") from None
    except RuntimeError as error:  # a request slipped in meanwhile
        raise APIError(409, str(error)) from None
    return {"ok": True}


DRAIN_ROUTE = "/hicache/drain"


@router.post(DRAIN_ROUTE, status_code=202)
async def drain(request: Request) -> dict[str, Any]:
    """Start draining this worker (``server/drain.py``): 202 with what it will do (the
    requests in flight to finish, the L1/L2 pages L3 lacks now, the deadline), 409 when it
    is draining already."""
    state = get_state(request)
    authorize(state, request)
    if state.drain is None:
        raise APIError(400, "this server has no drain")
    plan = await state.drain.begin("POST " + DRAIN_ROUTE)
    if plan is None:
        raise APIError(409, "the worker is draining already")
    return plan
