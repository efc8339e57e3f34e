"""``DELETE /hicache/tenants/{tenant}``: remove one tenant's cached KV from every tier.

Needs the admin key (``admin_api.authorize``: 400 without one configured, 401 with a
wrong one). ``tenant`` is a tenant name (``tenancy.names``: 1-128 of A-Z a-z 0-9 _ . :
@ -; anything else is a 400 and changes nothing); ``default`` names the default tenant
(requests without a cache salt). The tenant's queued and running requests are aborted,
its pages leave L1 and L2, then its L3 objects leave the attached store, within
``?timeout_s=`` (default ``DEFAULT_TIMEOUT_S``, at most ``MAX_TIMEOUT_S``): see
``Engine.purge_tenant``. The answer says what was removed::

    {"tenant", "device_pages", "host_pages", "l3_objects", "aborted_requests",
     "kept_device_pages", "kept_host_pages"}

with ``"l3_objects": null`` and ``"l3_error"`` when L3 is not attached or could not be
purged (the L1/L2 purge stands). An unknown tenant is a 200 with zeros: a purge is
idempotent. The KV events announce the removal (``events/emitter.py``).
"""

from __future__ import annotations

from typing import Any, Final

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from hicache.server.admin_api import authorize
from hicache.server.errors import APIError
from hicache.server.state import get_state
from hicache.tenancy.names import DEFAULT_TENANT_LABEL, check_tenant_name

router = APIRouter()

ROUTE = "/hicache/tenants/{tenant}"
DEFAULT_TIMEOUT_S: Final = 30.0
# Below the engine client's call timeout, so a slow store ends as l3_error, not a 500.
MAX_TIMEOUT_S: Final = 100.0


def tenant_key(name: str) -> str | None:
    """The extra key (cache salt) a tenant name stands for; ValueError for a bad name."""
    check_tenant_name(name)
    return None if name == DEFAULT_TENANT_LABEL else name


def purge_timeout(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise APIError(
            400, f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {raw!r}",
            param="timeout_s",
        )
    return value


@router.delete(ROUTE)
async def purge_tenant(tenant: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
    try:
        extra_key = tenant_key(tenant)
    except ValueError as error:
        raise APIError(400, str(error), param="tenant") from None
    timeout_s = purge_timeout(request.query_params.get("timeout_s"))
    engine: Any = state.engine  # the engine API has it, the protocol does not promise it
    result: dict[str, Any] = await run_in_threadpool(engine.purge_tenant, extra_key, timeout_s)
    answer = {"tenant": tenant, **result}
    if answer.get("l3_objects") is not None:
        answer.pop("l3_error", None)
    return answer
