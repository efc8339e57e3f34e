"""The router's FastAPI application with ``--pd-disaggregation``. Routes:

    POST /v1/chat/completions, /v1/completions, /generate   a prefill + decode pair
    GET  /v1/models, /get_model_info                        any healthy decode instance
    POST /tokenize, /detokenize (and /v1/...)               any healthy decode instance
    POST /flush_cache, /abort_request                       every healthy instance of both pools
    GET  /health, /get_server_info, /metrics, /workers      the router's own, both pools

A routed request's body is read as in the ordinary router (``app``): its
prompt is hashed into pages for the prefill choice and ``router_config_override``
is taken out; :class:`~hicache.router.pd_proxy.PDProxy` adds the bootstrap
fields. /health is 200 only while each pool has a healthy instance: with either
pool empty no request can be served. The worker list is fixed at start-up
(no POST /workers in this mode). The body limit and ``--admin-api-key`` guard
the same routes as in the ordinary router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from hicache import __version__
from hicache.router.app import (
    OVERRIDE_FIELD,
    aborts_all,
    admin_headers,
    authorize_admin,
    pop_override,
    read_json_object,
)
from hicache.router.fan_out import fan_out_answer
from hicache.router.metrics import CONTENT_TYPE, RouterMetrics
from hicache.router.pd_pools import NullIndex, PDPools, create_decode_chooser
from hicache.router.pd_proxy import PDProxy
from hicache.router.policy import LIVE_COST_POLICIES
from hicache.router.prompt import PromptKind, PromptTokenizer, body_cache_key, prompt_pages
from hicache.router.proxy import Proxy
from hicache.router.settings import RouterSettings
from hicache.router.types import RoutingPolicy, TierCosts, TierIndex
from hicache.router.workers import Worker, WorkerInfo, WorkerRegistry
from hicache.server.body_limit import BodyLimitMiddleware
from hicache.server.errors import install_error_handlers
from hicache.server.tenant import TenantMiddleware, request_tenant
from hicache.tokenizer.base import Tokenizer


@dataclass
class PDRouterState:
    settings: RouterSettings
    index: TierIndex
    policy: RoutingPolicy
    pools: PDPools
    proxy: PDProxy
    decode_proxy: Proxy  # for what any decode instance answers alike (/v1/models)
    metrics: RouterMetrics
    tokenizer: PromptTokenizer


def get_pd_state(request: Request) -> PDRouterState:
    state: PDRouterState = request.app.state.router
    return state


def create_pd_router_app(
    settings: RouterSettings, index: TierIndex, policy: RoutingPolicy,
    prefill: Sequence[WorkerInfo], decode: Sequence[WorkerInfo],
    tier_costs: dict[str, TierCosts] | None = None,
) -> FastAPI:
    """The PD app over ``index`` and ``policy`` (which choose the prefill instance);
    ``prefill`` and ``decode``: the instances, already discovered and checked
    (``serve.discover_pd_workers``)."""
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        timeout=settings.request_timeout_s,
    )
    interval = settings.health_interval_s
    pools = PDPools(
        # predicted_ttft prices the prefill instances with their live cost models (no
        # ledger here: the PD proxy enters nothing, so their queues read empty).
        prefill=WorkerRegistry(index, client, health_interval_s=interval, tier_costs=tier_costs,
                               live_costs=policy.name in LIVE_COST_POLICIES),
        decode=WorkerRegistry(NullIndex(), client, health_interval_s=interval),
        bootstrap_ports=PDPools.bootstrap_map(settings.prefill),
    )
    metrics = RouterMetrics(pools, index.num_pages)
    state = PDRouterState(
        settings=settings, index=index, policy=policy, pools=pools,
        proxy=PDProxy(pools, policy, create_decode_chooser(settings.decode_policy), metrics,
                      client, settings.request_timeout_s),
        # Its policy is never asked: only forward_any and fan_out are used.
        decode_proxy=Proxy(pools.decode, policy, metrics, client, settings.request_timeout_s),
        metrics=metrics, tokenizer=PromptTokenizer(settings.tokenizer),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            for info in prefill:
                pools.prefill.add(info)
            for info in decode:
                pools.decode.add(info)
            pools.start()
            if pools.prefill.reference is not None:
                await _tokenizer(state)  # loaded before the first request, not during it
            yield
        finally:
            await pools.stop()
            await client.aclose()

    app = FastAPI(title="hicache router (prefill-decode disaggregation)",
                  summary="routes each request to a prefill and a decode instance",
                  lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)
    if settings.identity.enabled:  # as the plain router (router/app.py)
        app.add_middleware(TenantMiddleware, identity=settings.identity)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)

    async def routed(request: Request, kind: PromptKind) -> Response:
        state = get_pd_state(request)
        body = await read_json_object(await request.body())
        multiplier = pop_override(body) if OVERRIDE_FIELD in body else None
        ids: list[int] = []
        hashes: list[int] = []
        reference = state.pools.prefill.reference
        tenant = request_tenant(request, body_cache_key(body))
        if reference is not None and state.pools.prefill.healthy():
            tokenizer = await _tokenizer(state)
            ids, hashes = await run_in_threadpool(prompt_pages, kind, body, tokenizer,
                                                  reference.page_size, tenant)
        return await state.proxy.route(request.url.path, body, request.headers, ids, hashes,
                                       multiplier, request.receive, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routed(request, PromptKind.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, PromptKind.COMPLETION)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await routed(request, PromptKind.GENERATE)

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")
    @app.get("/get_model_info")
    @app.get("/model_info")
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def any_decode(request: Request) -> Response:
        return await get_pd_state(request).decode_proxy.forward_any(
            request.method, request.url.path, request.headers, request.receive,
            await request.body())

    async def both_pools(request: Request, path: str, content: bytes | None = None, *,
                         include_draining: bool = False) -> dict[str, tuple[int, Any]]:
        state = get_pd_state(request)
        results: dict[str, tuple[int, Any]] = {}
        for registry in (state.pools.prefill, state.pools.decode):
            proxy = Proxy(registry, state.policy, state.metrics, client,
                          settings.request_timeout_s)
            results.update(await proxy.fan_out("POST", path, content,
                                               headers=admin_headers(request),
                                               include_draining=include_draining))
        return results

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache(request: Request) -> JSONResponse:
        authorize_admin(settings, request)
        return fan_out_answer(await both_pools(request, "/flush_cache"), "flushed")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        raw = await request.body()
        if settings.admin_api_key is not None and aborts_all(await read_json_object(raw)):
            authorize_admin(settings, request)
        # A request runs on a prefill and a decode instance alike: both pools are asked,
        # their draining instances too (their running requests finish there).
        results = await both_pools(request, "/abort_request", raw, include_draining=True)
        return fan_out_answer(results, "sent")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        pools = get_pd_state(request).pools
        prefill_up, decode_up = len(pools.prefill.healthy()), len(pools.decode.healthy())
        ok = prefill_up > 0 and decode_up > 0
        body = {"status": "ok" if ok else "unavailable",
                "healthy_prefill": prefill_up, "prefill": len(pools.prefill.all()),
                "healthy_decode": decode_up, "decode": len(pools.decode.all())}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        state = get_pd_state(request)
        reference = state.pools.prefill.reference
        return {
            "role": "router", "version": __version__, "pd_disaggregation": True,
            "policy": state.policy.name,
            "decode_policy": state.settings.decode_policy.value,
            "page_size": reference.page_size if reference else None,
            "served_model_name": reference.model if reference else None,
            "model_path": reference.model_path if reference else None,
            "tokenizer_path": reference.tokenizer_path if reference else None,
            "settings": state.settings.public(), "indexed_pages": state.index.num_pages(),
            **_pools_view(state),
        }

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        return Response(get_pd_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        return _pools_view(get_pd_state(request))

    return app


async def _tokenizer(state: PDRouterState) -> Tokenizer:
    reference = state.pools.prefill.reference
    paths = [reference.tokenizer_path, reference.model_path] if reference else []
    return await state.tokenizer.get(paths)


def _worker_view(worker: Worker) -> dict[str, Any]:
    return {**worker.info.public(), "healthy": worker.healthy, "state": worker.state,
            "draining": worker.draining, "active_requests": worker.active_requests}


def _pools_view(state: PDRouterState) -> dict[str, Any]:
    ports = state.pools.bootstrap_ports
    return {
        "prefill": [{**_worker_view(w), "bootstrap_port": ports[w.url],
                     "kv_events_last_sequence": w.event_counts.last_sequence}
                    for w in state.pools.prefill.all()],
        "decode": [_worker_view(w) for w in state.pools.decode.all()],
    }
