"""The access log: one line per HTTP request, with what the request cost in tokens.

``AccessLogMiddleware`` (on unless ``--disable-access-log``) writes, at info level
on the ``hicache.access`` logger, once the response is sent (a stream: once it
ended or the client left)::

    POST /v1/chat/completions 200 812.4ms prompt=412 cached=384 output=37 tenant=acme rid=chatc..

The token counts are summed over the request's engine requests (n samples, a
batch of prompts: each counts its own prompt and cached tokens, as the engine
saw them); requests that generate nothing log zeros and no rid. ``tenant`` is
the outermost tenant the request ran as (``tenancy.names.namespace_chain``: a salt
nested in a tenant is logged as the tenant, never the salt; ``default`` for none; ``-``
where no tenant was resolved). Never the prompt or output text. GET /health and GET
/metrics, which routers and Prometheus poll every few seconds, log at debug level instead.

How the counts arrive: the middleware puts a fresh ``AccessRecord`` in a context
variable; the route's work (the handler, its streaming body, the tasks it
starts, which copy the context) runs in that context, and ``Generation`` adds
each finished engine request to it (``record_output``). Cheap: one context
lookup per finished engine request and one log call per HTTP request.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.engine.api import GenerateOutput
from hicache.tenancy.names import DEFAULT_TENANT_LABEL, namespace_chain

logger = logging.getLogger("hicache.access")

# Polled: logged at debug level, so that a router's probes do not drown the log.
POLLED = frozenset({("GET", "/health"), ("GET", "/metrics")})


@dataclass
class AccessRecord:
    """What one HTTP request's engine requests reported when they finished."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    rids: list[str] = field(default_factory=list)
    tenant: str = "-"

    def describe_rid(self) -> str:
        if not self.rids:
            return "-"
        more = len(self.rids) - 1
        return self.rids[0] + (f" (+{more} more)" if more else "")


_current: ContextVar[AccessRecord | None] = ContextVar("hicache_access_record", default=None)


def record_tenant(extra_key: str | None) -> None:
    """Name the tenant the HTTP request being served runs as (if logged)."""
    record = _current.get()
    if record is not None:
        record.tenant = (DEFAULT_TENANT_LABEL if extra_key is None
                         else namespace_chain(extra_key)[0])


def record_output(output: GenerateOutput) -> None:
    """Count a finished engine request in the HTTP request it serves (if logged)."""
    record = _current.get()
    if record is None:
        return
    record.prompt_tokens += output.prompt_tokens
    record.cached_tokens += output.cached_tokens.total
    record.output_tokens += output.completion_tokens
    record.rids.append(output.rid)


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        record = AccessRecord()
        token = _current.set(record)
        status = 500  # what the client gets if the app raises before answering

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            _current.reset(token)
            method, path = scope.get("method", ""), scope.get("path", "")
            level = logging.DEBUG if (method, path) in POLLED else logging.INFO
            if logger.isEnabledFor(level):
                logger.log(
                    level, "%s %s %d %.1fms prompt=%d cached=%d output=%d tenant=%s rid=%s",
                    method, path, status, (time.monotonic() - started) * 1000,
                    record.prompt_tokens, record.cached_tokens, record.output_tokens,
                    record.tenant, record.describe_rid(),
                )
