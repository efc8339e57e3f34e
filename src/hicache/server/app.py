"""The FastAPI application: OpenAI and SGLang-style generation, cache control, metrics, admin.

``create_app(engine)`` wires the routes to a running engine; the caller owns
the engine and starts it before serving. ``on_shutdown`` (``hicache serve``
passes the engine's shutdown) runs when the server shuts down, after the last
connection closed: uvicorn re-raises a caught SIGTERM once it has stopped, so
code after ``uvicorn.run`` may never run. Routes:

    POST /v1/completions, /v1/chat/completions   GET /v1/models     (openai_api)
    POST (or PUT) /generate                                          (generate_api)
    POST /tokenize, /detokenize (and /v1/...), /abort_request;
    GET /health_generate                                             (native_api)
    PUT/GET/DELETE /hicache/storage-backend, POST /hicache/drain     (admin_api)
    POST /hicache/warm                                               (warm)
    POST /hicache/hints                                              (hints)
    DELETE /hicache/tenants/{tenant}                                 (tenants_api)
    POST /flush_cache   GET /health   GET /metrics
    GET /get_model_info, /model_info, /get_server_info, /server_info  (server_info)

Every request body is limited to ``max_request_bytes`` (``--max-request-bytes``,
a 413 beyond it: ``body_limit``) and parsed off the event loop when large
(``body``). Admin-attached L3 files stay under ``l3_path_root``
(``--l3-path-root``). The served model name defaults to the engine's; ``hicache serve`` passes
``--served-model-name``, else ``--model-path`` as given (as SGLang does). A request
naming another model, or none, is served that one model unless ``strict_model_name``
(``--strict-model-name``: a 404). With ``identity`` (``--api-keys``, ``--tenant-header``)
the model routes need a tenant's key and run as its tenant (``tenant``). Each request is
logged in one line (``access_log``; ``--disable-access-log`` turns it off).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from hicache import __version__
from hicache.server import (
    admin_api,
    generate_api,
    hints,
    native_api,
    openai_api,
    tenants_api,
    warm,
)
from hicache.server.access_log import AccessLogMiddleware
from hicache.server.admin_api import authorize_if_keyed
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from hicache.server.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainCollector, DrainEngine, Drainer
from hicache.server.errors import APIError, install_error_handlers
from hicache.server.l3_path_root import resolve_root
from hicache.server.metrics import ServerMetrics
from hicache.server.server_info import ServerInfo, l3_description, model_info, server_info
from hicache.server.state import ServedEngine, ServerState, get_state
from hicache.server.tenant import TenantMiddleware
from hicache.tenancy.identity import TenantIdentity

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(
    engine: ServedEngine, *, admin_api_key: str | None = None,
    admin_allow_dynamic_backend: bool = False, served_model_name: str | None = None,
    info: ServerInfo | None = None,
    on_shutdown: Callable[[], None] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    l3_path_root: str | Path | None = None,
    strict_model_name: bool = False,
    access_log: bool = True,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    on_drained: Callable[[], None] | None = None,
    warm_host_fraction: float = warm.DEFAULT_WARM_HOST_FRACTION,
    identity: TenantIdentity | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drain.loop = asyncio.get_running_loop()  # where a SIGTERM's drain is scheduled
        try:
            yield
        finally:
            if on_shutdown is not None:
                await run_in_threadpool(on_shutdown)  # it joins threads: off the event loop

    app = FastAPI(
        title="hicache", summary="LLM serving with a hierarchical KV cache", lifespan=lifespan
    )
    info = info or ServerInfo()
    app.state.hicache = ServerState(
        engine=engine,
        served_model_name=served_model_name or engine.model_name,
        admin_api_key=admin_api_key or None,  # an empty key would let anyone in
        metrics=ServerMetrics(engine),
        info=info,
        storage_config=dict(info.storage_config),
        admin_allow_dynamic_backend=admin_allow_dynamic_backend,
        l3_path_root=resolve_root(l3_path_root),
        strict_model_name=strict_model_name,
        warm_host_fraction=warm.check_fraction(warm_host_fraction),
    )
    state: ServerState = app.state.hicache
    drain = Drainer(
        cast(DrainEngine, engine), state.rids_in_flight, drain_timeout_s, on_done=on_drained
    )
    state.drain = drain
    state.metrics.registry.register(DrainCollector(drain))
    install_error_handlers(app)
    if identity is not None and identity.enabled:
        # Inside the body limit: a refused caller's body is never read at all.
        app.add_middleware(TenantMiddleware, identity=identity)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if access_log:  # outermost: it sees every answer, a 413 from the body limit too
        app.add_middleware(AccessLogMiddleware)
    app.include_router(openai_api.router)
    app.include_router(generate_api.router)
    app.include_router(admin_api.router)
    app.include_router(warm.router)
    app.include_router(hints.router)
    app.include_router(native_api.router)
    app.include_router(tenants_api.router)

    @app.get("/health", response_model=None)
    async def health(request: Request) -> dict[str, Any] | Response:
        state = get_state(request)
        if state.draining:  # the router stops sending here at once
            return JSONResponse({"status": "draining"}, status_code=503)
        # Off the event loop: an engine in its own process answers over its pipe.
        status = await run_in_threadpool(state.engine.storage_status)
        l3 = {key: status[key] for key in ("attached", "backend", "error") if key in status}
        return {"status": "ok", "model": state.served_model_name, "l3": l3}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = await run_in_threadpool(get_state(request).metrics.render)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache(request: Request) -> dict[str, Any]:
        """Drop every cached prefix in L1 and L2 (L3 keeps its pages); only when idle.
        With --admin-api-key set, it needs the key."""
        state = get_state(request)
        authorize_if_keyed(state, request)
        # The engine runs the flush on its scheduler thread; wait for it off the event loop.
        if not await run_in_threadpool(state.engine.flush_cache):
            raise APIError(409, "requests are running: flush the cache when the server is idle")
        return {"flushed": True, "message": "device and host caches flushed (L3 kept)"}

    # SGLang's router probes /model_info then /get_model_info (and the same for the
    # server info): both names answer.
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        state = get_state(request)
        engine = state.engine
        return {
            **model_info(state.info, state.served_model_name, engine.model_name),
            "max_context_len": engine.max_context_len, "vocab_size": engine.vocab_size,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        state = get_state(request)
        engine = state.engine
        l3 = l3_description(
            await run_in_threadpool(engine.storage_status), state.storage_config
        )
        counters = await run_in_threadpool(engine.metrics)
        pages, page_size = counters.get("device_pool_pages"), state.info.server_args.get(
            "page_size")
        info_args = state.info.server_args
        limits = {
            "max_total_num_tokens": int(pages * page_size) if pages and page_size else None,
            "max_req_input_len": engine.max_context_len,
            "context_length": engine.max_context_len,
            # What a router's warm-on-join may fill of the host pool (router/warm.py).
            "hicache_warm_host_fraction": state.warm_host_fraction,
            # Which attention backend runs (auto resolves per device); engines that do
            # not say (stand-ins in tests) report None.
            "attention_backend": getattr(engine, "attention_backend", None),
            # The default resolves per device: report what the scheduler uses.
            "chunked_prefill_size": getattr(
                engine, "chunked_prefill_size", info_args.get("chunked_prefill_size")
            ),
        }
        routing_info = getattr(engine, "routing_info", None)
        routing = routing_info() if routing_info is not None else None
        return {
            **server_info(
                state.info, state.served_model_name, l3, limits, counters, __version__, routing
            ),
            "draining": state.draining,
        }

    return app
