"""Send one request to a prefill instance and a decode instance at once; answer with decode's.

The pair's contract (as SGLang's): both get the same JSON body with
``bootstrap_host`` (the prefill instance's host), ``bootstrap_port`` (its
bootstrap server) and a fresh random ``bootstrap_room`` added. The decode
instance registers the room's pages at that bootstrap server, the prefill
instance computes the prompt's KV and writes it there, and answers its own copy
with the first token only; the router reads the prefill answer just for its
status. The decode answer streams to the client byte for byte (as
:class:`~hicache.router.proxy.Proxy` does).

Which failure the client sees:

- the prefill instance fails (an error status, or the connection) before the
  decode instance sent a byte of its answer: the decode request is dropped
  (closing its connection aborts it there) and the client gets the prefill's
  error, as the prefill sent it (502 when it could not be reached);
- the decode instance fails: the prefill request is dropped and the client gets
  the decode's error;
- the client leaves: both requests are dropped.

An instance that refuses the request as draining (``drain.py``: a 503 saying so,
or with ``Retry-After: 0``) before the decode answer streams is no failure: it
leaves its pool's routing as draining at once, the other request of the pair is
dropped and the request goes to a fresh pair, nothing of the refusal reaching the
client. An instance that refuses the connection before anything was sent is marked
down (its pool's registry hears every failure and answer status as the plain
proxy's does: ``health.py``) and the request goes to a fresh pair (a new room: the
old one named the failed pair), as the ordinary proxy retries. Once the decode answer streams,
a late prefill failure is only logged: the decode instance notices the missing
KV on its own (its transfer timeout) and fails its answer. A prefill answer
still missing when the decode answer ended gets ``PREFILL_GRACE_S`` more.

The router's /metrics counts these outcomes as the plain proxy's are (instance
failures by stage, retries, clients that left), and no message, log line or
label carries the credentials of an instance's URL (``credentials.redact``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx
from starlette.responses import Response
from starlette.types import Receive

from hicache.router.credentials import redact
from hicache.router.drain import is_draining_refusal
from hicache.router.metrics import RouterMetrics
from hicache.router.pd_pools import DecodeChooser, PDPools
from hicache.router.proxy import ClientGoneError, UpstreamResponse, client_gone, forwarded_headers
from hicache.router.types import RouteRequest, RoutingPolicy
from hicache.router.workers import Worker, WorkerRegistry
from hicache.server.errors import APIError

logger = logging.getLogger(__name__)

# SGLang's rooms are unsigned 63-bit: any int64 the decode side can keep.
ROOM_LIMIT = 2**63
# How long a prefill answer may still take once the decode answer ended.
PREFILL_GRACE_S = 10.0
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int

    def fields(self) -> dict[str, Any]:
        return {"bootstrap_host": self.host, "bootstrap_port": self.port,
                "bootstrap_room": self.room}


def new_bootstrap(prefill_url: str, port: int) -> Bootstrap:
    host = urlsplit(prefill_url).hostname
    assert host is not None  # checked when the url was registered
    return Bootstrap(host, port, secrets.randbelow(ROOM_LIMIT))


@dataclass(frozen=True)
class PrefillAnswer:
    """The prefill instance's whole answer (its first token), read for its status."""

    status: int
    content: bytes
    headers: Mapping[str, str]

    @property
    def ok(self) -> bool:
        return self.status < 400


@dataclass
class DecodeStart:
    """The decode instance's answer up to its first bytes (or whole, for an error)."""

    response: httpx.Response
    head: bytes
    rest: AsyncIterator[bytes] | None  # None: the answer was read whole


_Release = Callable[[], None]  # idempotent


class _Refused(Exception):
    """An instance refused the connection, or the request as draining: retry with another
    pair."""


class PDProxy:
    def __init__(
        self, pools: PDPools, policy: RoutingPolicy, decode_chooser: DecodeChooser,
        metrics: RouterMetrics, client: httpx.AsyncClient, request_timeout_s: float,
    ) -> None:
        self._pools = pools
        self._policy = policy
        self._decode_chooser = decode_chooser
        self._metrics = metrics
        self._client = client
        self._timeout = httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 5.0))

    async def route(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str],
        token_ids: list[int], hashes: list[int], shared_cache_multiplier: float | None,
        receive: Receive, tenant: str | None = None,
    ) -> Response:
        tried: list[str] = []
        while True:
            prefill = await self._choose_prefill(token_ids, hashes, shared_cache_multiplier,
                                                 tried, tenant)
            decode = self._choose_decode(tried)
            bootstrap = new_bootstrap(prefill.url, self._pools.bootstrap_ports[prefill.url])
            content = json.dumps({**body, **bootstrap.fields()}, ensure_ascii=False).encode()
            try:
                return await self._pair(path, content, headers, prefill, decode,
                                        len(hashes), receive)
            except _Refused as refused:
                tried.append(str(refused))
                self._metrics.retries.inc()

    # -- choosing the pair

    async def _choose_prefill(
        self, token_ids: list[int], hashes: list[int], multiplier: float | None,
        tried: list[str], tenant: str | None = None,
    ) -> Worker:
        candidates = [w for w in self._pools.prefill.healthy() if w.url not in tried]
        if not candidates:
            raise self._unavailable("prefill", len(self._pools.prefill.all()), tried)
        request = RouteRequest(
            page_hashes=hashes, prompt_tokens=len(token_ids),
            workers=[w.load() for w in candidates], shared_cache_multiplier=multiplier,
            page_size=self._pools.prefill.page_size, tenant=tenant,
        )
        started = time.perf_counter()
        decision = await self._policy.choose(request, token_ids)
        self._metrics.observe_decision(decision, len(hashes), time.perf_counter() - started)
        for worker in candidates:
            if worker.url == decision.worker:
                return worker
        raise APIError(500, f"the {self._policy.name} policy chose {redact(decision.worker)!r}, "
                       "which is not one of the healthy prefill instances it was given")

    def _choose_decode(self, tried: list[str]) -> Worker:
        candidates = [w for w in self._pools.decode.healthy() if w.url not in tried]
        if not candidates:
            raise self._unavailable("decode", len(self._pools.decode.all()), tried)
        return self._decode_chooser.choose(candidates)

    def _unavailable(self, role: str, known: int, tried: list[str]) -> APIError:
        self._metrics.unavailable.inc()
        if tried:
            return APIError(503, f"no healthy {role} instance could take the request: "
                            f"{', '.join(map(redact, tried))} refused the connection or "
                            "are draining")
        return APIError(503, f"no healthy {role} instance: all {known} registered {role} "
                        "instances are down (failing /health)")

    # -- one pair

    async def _pair(
        self, path: str, content: bytes, headers: Mapping[str, str], prefill: Worker,
        decode: Worker, pages: int, receive: Receive,
    ) -> Response:
        """Both requests at once; the response to give the client (or _Refused)."""
        release_prefill = _hold(prefill, pages)
        release_decode = _hold(decode, pages)
        self._metrics.sent(prefill.url)
        self._metrics.sent(decode.url)
        sent_headers = forwarded_headers(headers)
        prefill_task = asyncio.ensure_future(self._prefill(prefill, path, content,
                                                           sent_headers))
        prefill_task.add_done_callback(lambda _: release_prefill())
        prefill_task.add_done_callback(lambda task: _note_prefill(prefill.url, task))
        decode_task = asyncio.ensure_future(self._decode(decode, path, content, sent_headers))
        watch = asyncio.ensure_future(client_gone(receive))
        handed_over = False
        try:
            while True:
                pending = {t for t in (prefill_task, decode_task, watch) if not t.done()}
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if watch.done():
                    self._metrics.client_left("before_answer")  # both requests dropped
                    raise ClientGoneError
                if prefill_task.done() and not decode_task.done():
                    failure = await self._prefill_failure(prefill, prefill_task)
                    if failure is not None:
                        return failure  # the finally below drops the decode request
                    continue
                if decode_task.done():
                    response = await self._decode_response(decode, decode_task, prefill_task,
                                                           release_decode)
                    handed_over = isinstance(response, UpstreamResponse)
                    return response
        finally:
            watch.cancel()
            if not handed_over:
                await _drop(decode_task)
                release_decode()
                await _drop(prefill_task)
            await asyncio.gather(watch, return_exceptions=True)

    async def _prefill_failure(
        self, prefill: Worker, task: asyncio.Future[PrefillAnswer],
    ) -> Response | None:
        """The client's answer when the finished prefill request failed; None when it
        succeeded (the decode answer is still to come)."""
        error = task.exception()
        if error is None:
            answer = task.result()
            if is_draining_refusal(answer.status, answer.headers, answer.content):
                await self._drained("prefill", prefill)
            await self._pools.prefill.answered(prefill.url, answer.status)  # 5xx: a failure
            if answer.ok:
                return None
            logger.warning("prefill instance %s answered %d: dropping the decode request",
                           redact(prefill.url), answer.status)
            return Response(answer.content, status_code=answer.status,
                            headers=forwarded_headers(answer.headers))
        return await self._connection_failure("prefill", prefill, error)

    async def _decode_response(
        self, decode: Worker, task: asyncio.Future[DecodeStart],
        prefill_task: asyncio.Future[PrefillAnswer], release_decode: _Release,
    ) -> Response:
        error = task.exception()
        if error is not None:
            return await self._connection_failure("decode", decode, error)
        start = task.result()
        response = start.response
        if start.rest is None and is_draining_refusal(response.status_code, response.headers,
                                                      start.head):
            await self._drained("decode", decode)
        await self._pools.decode.answered(decode.url, start.response.status_code)
        if start.rest is None:  # an error status, read whole
            logger.warning("decode instance %s answered %d: dropping the prefill request",
                           redact(decode.url), start.response.status_code)
            return Response(start.head, status_code=start.response.status_code,
                            headers=forwarded_headers(start.response.headers))

        def close() -> None:
            release_decode()
            if not prefill_task.done():
                # The decode answer ended (or its client left) before the prefill answer
                # came: the KV has landed, so the prefill instance is finishing its copy.
                # Leave it that long rather than abort a request that is done there.
                asyncio.get_running_loop().call_later(PREFILL_GRACE_S, prefill_task.cancel)

        return UpstreamResponse(start.response, close, head=start.head, raw=start.rest,
                                metrics=self._metrics, worker=decode.url)

    async def _connection_failure(self, role: str, worker: Worker,
                                  error: BaseException) -> Response:
        if isinstance(error, httpx.TimeoutException):
            self._metrics.worker_failed(worker.url, "timeout")
        elif isinstance(error, httpx.HTTPError):
            self._metrics.worker_failed(worker.url, "before_answer")
        if isinstance(error, httpx.HTTPError):
            # Refused: out of its pool's routing at once; dropped: a failure; a timeout: slow.
            await self._registry(role).connection_failed(worker.url, error)
        if isinstance(error, _REFUSED):
            raise _Refused(worker.url)
        if isinstance(error, httpx.TimeoutException):
            raise APIError(504, f"{role} instance {redact(worker.url)} did not answer within "
                           "the request timeout (--request-timeout)")
        if isinstance(error, httpx.HTTPError):
            raise APIError(502, redact(f"{role} instance {worker.url} failed: "
                                       f"{type(error).__name__}: {error}"))
        raise error

    async def _drained(self, role: str, worker: Worker) -> NoReturn:
        """``worker`` refused the request as draining: out of its pool's routing, and the
        request goes to a fresh pair (the caller's finally drops the other request)."""
        self._metrics.drain_refused(worker.url)
        await self._registry(role).mark_draining(worker.url, "refused a request as draining")
        raise _Refused(worker.url)

    def _registry(self, role: str) -> WorkerRegistry:
        return self._pools.prefill if role == "prefill" else self._pools.decode

    # -- the two requests

    async def _prefill(self, worker: Worker, path: str, content: bytes,
                       headers: Mapping[str, str]) -> PrefillAnswer:
        request = self._client.build_request("POST", f"{worker.url}{path}", content=content,
                                             headers=headers, timeout=self._timeout)
        response = await self._client.send(request, stream=True)
        try:
            body = await response.aread()
        finally:
            await response.aclose()  # also when cancelled: the instance aborts the request
        return PrefillAnswer(response.status_code, body, response.headers)

    async def _decode(self, worker: Worker, path: str, content: bytes,
                      headers: Mapping[str, str]) -> DecodeStart:
        request = self._client.build_request("POST", f"{worker.url}{path}", content=content,
                                             headers=headers, timeout=self._timeout)
        response = await self._client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                body = await response.aread()
                await response.aclose()
                return DecodeStart(response, body, None)
            rest = response.aiter_raw()
            head = b""
            async for chunk in rest:
                if chunk:
                    head = chunk
                    break
            return DecodeStart(response, head, rest)
        except BaseException:
            await response.aclose()
            raise


def _hold(worker: Worker, pages: int) -> _Release:
    """Count a request against ``worker``'s load; the returned callable undoes it once."""
    worker.active_requests += 1
    worker.active_prompt_pages += pages
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            worker.active_requests -= 1
            worker.active_prompt_pages -= pages

    return release


def _note_prefill(url: str, task: asyncio.Future[PrefillAnswer]) -> None:
    """Log how a prefill request ended. Also retrieves its error: after the decode answer
    was handed over nobody else looks at it."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.info("prefill instance %s: %s: %s", redact(url), type(error).__name__,
                    redact(str(error)))
    elif not task.result().ok:
        logger.info("prefill instance %s answered %d", redact(url), task.result().status)


async def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (closing its connection aborts the request at the instance) and
    close the answer it may already hold."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        result = await task
        if isinstance(result, DecodeStart):
            await result.response.aclose()
