"""The router's FastAPI application. Routes:

    POST /v1/chat/completions, /v1/completions, /generate   routed by the policy
    GET  /v1/models, /get_model_info                        any healthy worker's answer
    POST /tokenize, /detokenize (and /v1/...)               any healthy worker's answer
    POST /flush_cache                                       every healthy worker
    POST /abort_request                                     every healthy or draining one
    POST /hicache/hints                                     where each prefix is (``hints``)
    GET  /health, /get_server_info, /metrics                the router's own
    GET  /decisions?limit=N                                 the last N decisions (``decisions``)
    GET/POST/DELETE /workers                                the worker list (admin)

A routed request's JSON body is read once: its prompt is hashed into pages
(``prompt``), ``router_config_override`` (the router's, Dynamo's per-request
``shared_cache_multiplier``) is taken out, and the rest goes to the worker as
sent. A body that is not a JSON object is a 400 and no worker hears of it.
With ``--api-keys`` / ``--tenant-header`` the router resolves each request's tenant as
its workers do (``tenancy.identity``: a 401 for a missing key before anything else),
hashes its pages in that tenant's chain and forwards the credentials unchanged.
A body over ``--max-request-bytes`` is a 413 before it is read, and a large one
is parsed off the event loop. With ``--admin-api-key``, changing the worker
list, /flush_cache and /abort_request with ``abort_all`` need ``Authorization:
Bearer <key>``, as on the workers; the client's key goes on to the workers of
a fan-out, which check their own.
"""

from __future__ import annotations

import json
import math
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
from hicache.router.decisions import DEFAULT_LIMIT, MAX_DECISIONS
from hicache.router.fan_out import fan_out_answer
from hicache.router.hints import HINTS_PATH, forward_hints, metric_labels
from hicache.router.hints import parse_body as parse_hints
from hicache.router.history import RequestHistory
from hicache.router.metrics import CONTENT_TYPE, RouterMetrics
from hicache.router.policy import LIVE_COST_POLICIES
from hicache.router.prompt import (
    PromptKind,
    PromptTokenizer,
    body_cache_key,
    body_max_new_tokens,
    prompt_pages,
)
from hicache.router.proxy import Proxy
from hicache.router.settings import RouterSettings, SettingsError, check_worker_url
from hicache.router.types import RoutingPolicy, TierCosts, TierIndex
from hicache.router.warm import JoinWarmer
from hicache.router.workers import WorkerError, WorkerInfo, WorkerRegistry
from hicache.server.admin_api import check_bearer
from hicache.server.body import sized_off_loop
from hicache.server.body_limit import BodyLimitMiddleware
from hicache.server.errors import APIError, install_error_handlers
from hicache.server.tenant import TenantMiddleware, request_caller, request_tenant
from hicache.tokenizer.base import Tokenizer

OVERRIDE_FIELD = "router_config_override"
_OVERRIDE_KEYS = ("shared_cache_multiplier",)


@dataclass
class RouterState:
    settings: RouterSettings
    index: TierIndex
    policy: RoutingPolicy
    workers: WorkerRegistry
    proxy: Proxy
    metrics: RouterMetrics
    tokenizer: PromptTokenizer
    history: RequestHistory  # recent prompts, for warming joining workers


def get_router_state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


async def read_json_object(raw: bytes) -> dict[str, Any]:
    """``parse_json_object``, off the event loop for a large body (``server.body``)."""
    return await sized_off_loop(len(raw), lambda: parse_json_object(raw))


def aborts_all(body: dict[str, Any]) -> bool:
    """Does an /abort_request body stop every request (the part that needs the key)?"""
    return body.get("abort_all") is True


def admin_headers(request: Request) -> dict[str, str] | None:
    """The client's admin key, passed on to the workers of a fan-out (they check it)."""
    key = request.headers.get("authorization")
    return {"authorization": key} if key else None


def tenant_headers(request: Request, settings: RouterSettings) -> dict[str, str] | None:
    """The client's key and, with --tenant-header, that header: what a worker needs to
    resolve the same tenant the router did."""
    headers = admin_headers(request) or {}
    name = settings.identity.tenant_header
    if name is not None and name in request.headers:
        headers[name] = request.headers[name]
    return headers or None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def pop_override(body: dict[str, Any]) -> float | None:
    """Take ``router_config_override`` out of ``body``; its shared_cache_multiplier."""
    override = body.pop(OVERRIDE_FIELD)
    if override is None:
        return None
    if not isinstance(override, dict):
        raise APIError(400, f"{OVERRIDE_FIELD} must be an object", param=OVERRIDE_FIELD)
    unknown = sorted(set(override) - set(_OVERRIDE_KEYS))
    if unknown:
        raise APIError(400, f"{OVERRIDE_FIELD}: unrecognized field {unknown[0]!r} (the router "
                       f"takes {', '.join(_OVERRIDE_KEYS)})",
                       param=f"{OVERRIDE_FIELD}.{unknown[0]}")
    value = override.get("shared_cache_multiplier")
    param = f"{OVERRIDE_FIELD}.shared_cache_multiplier"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise APIError(400, f"{param} must be a number", param=param)
    if value < 0:
        raise APIError(400, f"{param} must be >= 0 (got {value})", param=param)
    return float(value)


def create_router_app(
    settings: RouterSettings, index: TierIndex, policy: RoutingPolicy,
    workers: Sequence[WorkerInfo] = (), tier_costs: dict[str, TierCosts] | None = None,
) -> FastAPI:
    """The app over ``index`` and ``policy``; ``workers`` (already discovered and checked,
    see ``serve.discover_workers``) are registered when it starts. ``tier_costs``: the
    mapping the policy reads each worker's measured costs from (None: fixed costs); the
    health probes keep it current."""
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        timeout=settings.request_timeout_s,
    )
    history = RequestHistory()
    warmer = JoinWarmer(history, client, settings.warm_on_join_timeout_s,
                        settings.admin_api_key)
    # A policy that prices with the workers' live cost models has them probed.
    registry = WorkerRegistry(index, client, health_interval_s=settings.health_interval_s,
                              tier_costs=tier_costs, warmer=warmer,
                              live_costs=policy.name in LIVE_COST_POLICIES)
    metrics = RouterMetrics(registry, index.num_pages, warmer=warmer)
    state = RouterState(
        settings=settings, index=index, policy=policy, workers=registry,
        proxy=Proxy(registry, policy, metrics, client, settings.request_timeout_s),
        metrics=metrics, tokenizer=PromptTokenizer(settings.tokenizer), history=history,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            for info in workers:
                registry.add(info)
            registry.start()
            if registry.reference is not None:
                await _tokenizer(state)  # loaded before the first request, not during it
            yield
        finally:
            await registry.stop()
            await client.aclose()

    app = FastAPI(title="hicache router", summary="routes requests to where their prefix is "
                  "cheapest", lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)
    if settings.identity.enabled:
        # The same identity as the workers': a refused caller costs no tokenizing and
        # no worker hears of it; the credentials then go on to the worker as sent.
        app.add_middleware(TenantMiddleware, identity=settings.identity)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)

    async def routed(request: Request, kind: PromptKind) -> Response:
        state = get_router_state(request)
        raw = await request.body()
        body = await read_json_object(raw)
        multiplier = None
        if OVERRIDE_FIELD in body:
            multiplier = pop_override(body)
            raw = await sized_off_loop(
                len(raw), lambda: json.dumps(body, ensure_ascii=False).encode())
        reference = state.workers.reference
        if reference is None or not state.workers.healthy():
            # Answered before tokenizing: there is nowhere to send it.
            return await state.proxy.route(request.url.path, raw, request.headers, [], [],
                                           multiplier, request.receive)
        tokenizer = await _tokenizer(state)
        tenant = request_tenant(request, body_cache_key(body))
        ids, hashes = await run_in_threadpool(prompt_pages, kind, body, tokenizer,
                                              reference.page_size, tenant)
        rid = body.get("rid")
        response = await state.proxy.route(request.url.path, raw, request.headers, ids,
                                           hashes, multiplier, request.receive, tenant,
                                           stream=body.get("stream") is True,
                                           rid=rid if isinstance(rid, str) else None,
                                           max_new_tokens=body_max_new_tokens(kind, body))
        # A prompt a worker took is worth warming a joining worker with; a tenant's only
        # with its credentials, which the router does not keep: the default tenant's only.
        if response.status_code == 200 and tenant is None:
            state.history.record(ids, hashes)
        return response

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
    async def any_worker(request: Request) -> Response:
        state = get_router_state(request)
        return await state.proxy.forward_any(request.method, request.url.path, request.headers,
                                             request.receive, await request.body())

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache(request: Request) -> JSONResponse:
        state = get_router_state(request)
        _authorize(state, request)
        results = await state.proxy.fan_out("POST", "/flush_cache",
                                            headers=admin_headers(request))
        return fan_out_answer(results, "flushed")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        state = get_router_state(request)
        raw = await request.body()
        if state.settings.admin_api_key is not None and aborts_all(await read_json_object(raw)):
            _authorize(state, request)
        # The router does not keep which worker runs a rid: every worker is asked, the
        # draining ones too (their running requests finish there).
        results = await state.proxy.fan_out("POST", "/abort_request", raw,
                                            headers=admin_headers(request),
                                            include_draining=True)
        return fan_out_answer(results, "sent")

    @app.post(HINTS_PATH)
    async def hints(request: Request) -> dict[str, Any]:
        """Each hint to the worker(s) its prefix is on (``router/hints.py``)."""
        state = get_router_state(request)
        body = await read_json_object(await request.body())
        reference = state.workers.reference
        workers = state.workers.healthy()
        if reference is None or not workers:
            parse_hints(body)  # a malformed body is still a 400
            raise APIError(503, "no healthy worker to send the hints to")
        tokenizer = await _tokenizer(state)
        # The client's key, and the gateway's tenant header, as sent.
        headers = tenant_headers(request, state.settings)

        async def send(url: str, content: bytes) -> tuple[int, Any]:
            return await state.proxy.request_json(url, "POST", HINTS_PATH, content, headers)

        context = reference.server_info.get("max_req_input_len")
        answer = await forward_hints(
            body, workers, state.policy, state.index, reference.page_size, tokenizer, send,
            max_prefix_tokens=context if isinstance(context, int) and context > 0 else None,
            caller=request_caller(request),
        )
        for outcome in answer["results"]:
            state.metrics.hints.labels(*metric_labels(outcome)).inc()
        return answer

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        registry = get_router_state(request).workers
        healthy = len(registry.healthy())
        body = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
                "draining_workers": sum(1 for w in registry.all() if w.draining),
                "workers": len(registry.all())}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        state = get_router_state(request)
        reference = state.workers.reference
        return {
            "role": "router", "version": __version__, "policy": state.policy.name,
            "page_size": reference.page_size if reference else None,
            "served_model_name": reference.model if reference else None,
            "model_path": reference.model_path if reference else None,
            "tokenizer_path": reference.tokenizer_path if reference else None,
            "settings": state.settings.public(), "indexed_pages": state.index.num_pages(),
            "workers": _workers_view(state),
        }

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        return Response(get_router_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/decisions")
    async def decisions(request: Request, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        """The last ``limit`` (<= 1024) routing decisions, predicted and measured TTFT."""
        if not 0 <= limit <= MAX_DECISIONS:
            raise APIError(400, f"limit must be in 0..{MAX_DECISIONS}, got {limit}",
                           param="limit")
        return {"decisions": get_router_state(request).proxy.decisions.last(limit)}

    @app.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        return {"workers": _workers_view(get_router_state(request))}

    @app.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        state = get_router_state(request)
        _authorize(state, request)
        body = parse_json_object(await request.body())
        url = body.get("url")
        if not isinstance(url, str):
            raise APIError(400, "send {\"url\": \"http://host:port\"}", param="url")
        try:
            worker = await state.workers.add_url(check_worker_url(url))
        except SettingsError as error:
            raise APIError(400, str(error), param="url") from None
        except WorkerError as error:
            raise APIError(error.status, str(error), param="url") from None
        await _tokenizer(state)
        return JSONResponse({"added": worker.info.public()}, status_code=201)

    @app.delete("/workers")
    async def remove_worker(request: Request, url: str | None = None) -> dict[str, Any]:
        state = get_router_state(request)
        _authorize(state, request)
        if not url:
            raise APIError(400, "name the worker: DELETE /workers?url=http://host:port",
                           param="url")
        try:
            await state.workers.remove(url)
        except WorkerError as error:
            raise APIError(error.status, str(error), param="url") from None
        return {"removed": url}

    return app


async def _tokenizer(state: RouterState) -> Tokenizer:
    reference = state.workers.reference
    paths = [reference.tokenizer_path, reference.model_path] if reference else []
    return await state.tokenizer.get(paths)


def _authorize(state: RouterState, request: Request) -> None:
    authorize_admin(state.settings, request)


def authorize_admin(settings: RouterSettings, request: Request) -> None:
    """APIError(401) unless the request carries ``--admin-api-key`` (when one is set)."""
    if settings.admin_api_key is not None:
        check_bearer(settings.admin_api_key, request)


def _workers_view(state: RouterState) -> list[dict[str, Any]]:
    return [
        {**w.info.public(), "healthy": w.healthy, "state": w.state, "draining": w.draining,
         "warming": w.warming,
         "active_requests": w.active_requests,
         "kv_events_last_sequence": w.event_counts.last_sequence}
        for w in state.workers.all()
    ]
