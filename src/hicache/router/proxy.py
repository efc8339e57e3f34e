"""Send a request to the worker the policy chose and pass its answer back unchanged.

The answer streams through byte for byte (``aiter_raw``: no decoding, no
re-chunking of SSE events), status and headers included. A client that goes
away closes the connection to the worker at once, which is how a worker learns
to abort the request. A worker that fails before answering anything (refused
connection, connection dropped before the status line) is left out and the
request goes to the next choice; once a byte came back, a failure is the
client's to see (the router closes the connection rather than end the answer
as if it were whole). A worker silent past ``--request-timeout`` is a 504, not
retried: it may still be working on the request. Each of these outcomes is
counted in the router's /metrics (``RouterMetrics``: worker failures by stage,
retries, clients that left), and no message, log line or label carries the
credentials of a worker's URL (``credentials.redact``). The registry hears each of
them, and each answer's status, as the worker's health (``health.py``: refused, out
at once; dropped or a 5xx, a failure; a timeout, slowness). A worker that refuses the
request as draining (``drain.py``: a 503 saying so, or with ``Retry-After: 0``) is no
failure: the refusal is read whole, nothing of it reaches the client, the request
goes to the next choice and the worker leaves routing as draining at once. A stream
is refused by its status line, before any event: it is retried alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hicache.router.credentials import redact
from hicache.router.decisions import DecisionLog
from hicache.router.drain import MAX_REFUSAL_BYTES, is_draining_refusal, says_retry_now
from hicache.router.metrics import RouterMetrics
from hicache.router.types import RouteDecision, RouteRequest, RoutingPolicy
from hicache.router.workers import Worker, WorkerRegistry
from hicache.server.errors import APIError

logger = logging.getLogger(__name__)

# Not passed on in either direction: they describe one connection, not the message;
# content-length is recomputed (the body is streamed), server and date are the router's.
_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length", "server", "date",
})
# Failures that mean the worker never got (or never began answering) the request.
_BEFORE_ANSWER = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                  httpx.ReadError, httpx.WriteError)
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


class UpstreamResponse(StreamingResponse):
    """A worker's answer, streamed to the client while watching for the client leaving.

    ``head`` and ``raw``: when the caller already read the answer's first bytes (the PD
    proxy waits for them), those bytes and the iterator the rest comes from. ``metrics``
    and ``worker``: where a client leaving mid-answer, or the worker failing, is counted.
    ``on_first_byte``: called once, as the answer's first body byte goes to the client."""

    def __init__(
        self, upstream: httpx.Response, on_close: Callable[[], None], *, head: bytes = b"",
        raw: AsyncIterator[bytes] | None = None, metrics: RouterMetrics | None = None,
        worker: str = "", on_first_byte: Callable[[], None] | None = None,
    ) -> None:
        self._raw = raw if raw is not None else upstream.aiter_raw()
        super().__init__(self._raw, status_code=upstream.status_code,
                         headers=forwarded_headers(upstream.headers))
        self._upstream = upstream
        self._on_close = on_close
        self._head = head
        self._metrics = metrics
        self._worker = worker
        self._on_first_byte = on_first_byte

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(self._watch(receive))
            try:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watch):
                    task.cancel()
                await asyncio.gather(pump, watch, return_exceptions=True)
            failed = pump.done() and not pump.cancelled() and pump.exception() is not None
            if self._metrics is not None:
                if failed:
                    self._metrics.worker_failed(self._worker, "mid_answer")
                elif watch.done() and not watch.cancelled():
                    self._metrics.client_left("answering")
            if failed:
                # The worker failed mid-answer: end the connection, not the body, so the
                # client cannot take a cut answer for a whole one.
                raise pump.exception()  # type: ignore[misc]
        finally:
            # Closing drops the connection to the worker: a client that left aborts it there.
            await self._upstream.aclose()
            self._on_close()

    async def _pump(self, send: Send) -> None:
        if self._head:
            self._first_byte()
            await send({"type": "http.response.body", "body": self._head, "more_body": True})
        async for chunk in self._raw:
            if chunk:
                self._first_byte()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _first_byte(self) -> None:
        callback, self._on_first_byte = self._on_first_byte, None
        if callback is not None:
            callback()

    @staticmethod
    async def _watch(receive: Receive) -> None:
        await client_gone(receive)


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (call once the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _nothing() -> AsyncIterator[bytes]:
    """The rest of a body already read whole."""
    return
    yield  # an async generator that yields nothing


class ClientGoneError(APIError):
    """The client left before the worker answered; nobody reads this answer."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request")


class Proxy:
    def __init__(
        self, workers: WorkerRegistry, policy: RoutingPolicy, metrics: RouterMetrics,
        client: httpx.AsyncClient, request_timeout_s: float,
    ) -> None:
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._client = client
        self._timeout = httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 5.0))
        self.decisions = DecisionLog()  # GET /decisions

    async def route(
        self, path: str, content: bytes, headers: Mapping[str, str], token_ids: list[int],
        hashes: list[int], shared_cache_multiplier: float | None, receive: Receive,
        tenant: str | None = None, stream: bool = False, rid: str | None = None,
        max_new_tokens: int | None = None,
    ) -> UpstreamResponse:
        """POST ``content`` to the policy's choice among healthy workers, next choice on a
        failure before any answer; APIError(503) when none is left. ``stream``: the
        client asked for a streamed answer (its first byte is its first token); ``rid``:
        the request id the client gave it (/generate's ``rid``), logged with the decision;
        ``max_new_tokens``: the most tokens it may generate, as its body says."""
        tried: list[str] = []
        page_size = self._workers.page_size
        held_pages = 0.0
        if page_size:  # its device footprint while it runs, for the ledger (device_room.py)
            held_pages = float(-(-len(token_ids) // page_size)
                               + -(-(max_new_tokens or 0) // page_size))
        while True:
            # Warming workers only when no other is left (``WorkerRegistry.routable``).
            candidates = self._workers.routable(excluding=tried)
            if not candidates:
                raise self._unavailable(tried)
            request = RouteRequest(
                page_hashes=hashes, prompt_tokens=len(token_ids),
                workers=[w.load() for w in candidates],
                shared_cache_multiplier=shared_cache_multiplier,
                page_size=page_size, tenant=tenant, max_new_tokens=max_new_tokens,
            )
            started = time.perf_counter()
            decision = await self._policy.choose(request, token_ids)
            self._metrics.observe_decision(decision, len(hashes), time.perf_counter() - started)
            worker = self._chosen(decision, candidates)
            response = await self._try(worker, "POST", path, content, headers,
                                       pages=len(hashes), receive=receive,
                                       decision=decision, stream=stream, rid=rid,
                                       held_pages=held_pages)
            if response is not None:
                return response
            tried.append(worker.url)
            self._metrics.retries.inc()

    async def forward_any(self, method: str, path: str, headers: Mapping[str, str],
                          receive: Receive, content: bytes = b"") -> UpstreamResponse:
        """A request any worker answers alike (/v1/models, /tokenize): the first healthy
        one."""
        tried: list[str] = []
        for worker in self._workers.healthy():
            response = await self._try(worker, method, path, content, headers, pages=0,
                                       receive=receive)
            if response is not None:
                return response
            tried.append(worker.url)
        raise self._unavailable(tried)

    async def fan_out(
        self, method: str, path: str, content: bytes | None = None,
        headers: Mapping[str, str] | None = None, *, include_draining: bool = False,
    ) -> dict[str, tuple[int, Any]]:
        """The same request (``content``: a JSON body; ``headers``: the client's admin key)
        to every healthy worker, and with ``include_draining`` the draining ones too (they
        still run requests): url -> (status, JSON answer or text); status 502 for a
        worker that could not be reached."""
        workers = self._workers.reachable() if include_draining else self._workers.healthy()
        if not workers:
            raise self._unavailable([])
        results = await asyncio.gather(
            *(self.request_json(w.url, method, path, content, headers) for w in workers))
        return {w.url: result for w, result in zip(workers, results, strict=True)}

    async def request_json(
        self, url: str, method: str, path: str, content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One worker's answer to a small request: (status, JSON answer or text); status
        502 when it could not be reached."""
        sent = {**(headers or {}), **({"content-type": "application/json"} if content else {})}
        try:
            response = await self._client.request(
                method, f"{url}{path}", content=content, timeout=self._timeout,
                headers=sent or None,
            )
        except httpx.HTTPError as error:
            self._metrics.worker_failed(url, "before_answer")
            return 502, redact(f"{type(error).__name__}: {error}")
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text

    def _chosen(self, decision: RouteDecision, candidates: list[Worker]) -> Worker:
        for worker in candidates:
            if worker.url == decision.worker:
                return worker
        raise APIError(500, f"the {self._policy.name} policy chose {redact(decision.worker)!r}, "
                       "which is not one of the healthy workers it was given")

    async def _try(
        self, worker: Worker, method: str, path: str, content: bytes,
        headers: Mapping[str, str], *, pages: int, receive: Receive,
        decision: RouteDecision | None = None, stream: bool = False, rid: str | None = None,
        held_pages: float = 0.0,
    ) -> UpstreamResponse | None:
        """The worker's answer (its status and headers in; body still to stream), or None
        when it failed before answering. A client leaving meanwhile (a non-streamed answer
        comes only when it is whole) drops the request to the worker too. ``decision``:
        the routing decision it was sent on: its predicted prefill enters the worker's
        ledger until the first byte (or the end, however it comes)."""
        worker.active_requests += 1
        worker.active_prompt_pages += pages
        entry = None if decision is None else worker.ledger.admit(
            decision.predicted_prefill_s, decision.prefill_pages, held_pages)
        logged = None if decision is None else self.decisions.record(decision, stream, rid)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                worker.active_requests -= 1
                worker.active_prompt_pages -= pages
                if entry is not None:
                    entry.close()

        def first_byte() -> None:
            if entry is None or decision is None:
                return
            measured = entry.first_token()
            if measured is not None and stream and logged is not None:
                logged["measured_ttft_s"] = measured
                self._metrics.observe_first_token(decision, measured)

        request = self._client.build_request(
            method, f"{worker.url}{path}", content=content or None,
            headers=forwarded_headers(headers), timeout=self._timeout,
        )
        try:
            upstream = await self._send_unless_gone(request, receive)
        except _BEFORE_ANSWER as error:
            release()
            self._metrics.worker_failed(worker.url, "before_answer")
            logger.warning("worker %s failed before answering %s: %s: %s", redact(worker.url),
                           path, type(error).__name__, redact(str(error)))
            # Refused: out of routing at once; dropped: a failure; a connect timeout: slow.
            await self._workers.connection_failed(worker.url, error)
            return None
        except httpx.TimeoutException as error:
            release()
            self._metrics.worker_failed(worker.url, "timeout")
            await self._workers.connection_failed(worker.url, error)
            raise APIError(504, f"worker {redact(worker.url)} did not answer within the "
                           "request timeout (--request-timeout)") from None
        except ClientGoneError:
            release()  # the client left while waiting: the request is dropped with it
            self._metrics.client_left("before_answer")
            raise
        except BaseException:
            release()
            raise
        head, rest = b"", None
        if upstream.status_code == 503:
            try:
                draining, head, rest = await self._read_refusal(upstream)
            except httpx.HTTPError as error:  # broke off inside an error body: not sent yet
                await upstream.aclose()
                release()
                self._metrics.worker_failed(worker.url, "before_answer")
                await self._workers.connection_failed(worker.url, error)
                return None
            if draining:
                await upstream.aclose()
                release()
                self._metrics.drain_refused(worker.url)
                await self._workers.mark_draining(worker.url, f"refused {path} as draining")
                return None
        self._metrics.sent(worker.url)
        await self._workers.answered(worker.url, upstream.status_code)  # a 5xx is a failure
        return UpstreamResponse(upstream, release, head=head, raw=rest, metrics=self._metrics,
                                worker=worker.url, on_first_byte=first_byte)

    @staticmethod
    async def _read_refusal(upstream: httpx.Response,
                            ) -> tuple[bool, bytes, AsyncIterator[bytes] | None]:
        """Whether a 503 is a draining worker's refusal; when it is not, what was read of
        its body and the iterator the rest comes from (empty: the body was whole)."""
        if says_retry_now(upstream.status_code, upstream.headers):
            return True, b"", None
        chunks = upstream.aiter_raw()
        head = b""
        async for chunk in chunks:
            head += chunk
            if len(head) > MAX_REFUSAL_BYTES:  # too long for a refusal: pass it on
                return False, head, chunks
        draining = is_draining_refusal(upstream.status_code, upstream.headers, head)
        return draining, head, _nothing()

    async def _send_unless_gone(self, request: httpx.Request, receive: Receive,
                                ) -> httpx.Response:
        send = asyncio.ensure_future(self._client.send(request, stream=True))
        watch = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not send.done():
                send.cancel()  # closes the connection: the worker aborts the request
            await asyncio.gather(send, watch, return_exceptions=True)
        if send.cancelled():
            raise ClientGoneError
        return send.result()

    def _unavailable(self, tried: list[str]) -> APIError:
        self._metrics.unavailable.inc()
        known = len(self._workers.all())
        if tried:
            return APIError(503, f"no healthy worker could take the request: "
                            f"{', '.join(map(redact, tried))} failed before answering")
        draining = sum(1 for w in self._workers.all() if w.draining)
        if known and draining:
            return APIError(503, f"no healthy worker: of {known} registered workers, "
                            f"{draining} are draining and the rest down (failing /health)")
        if known:
            return APIError(503, f"no healthy worker: all {known} registered workers are "
                            "down (failing /health)")
        return APIError(503, "no worker registered: start the router with --worker-urls "
                        "or add one with POST /workers")
