"""One engine request as a route handler consumes it.

``start_generation`` waits for the engine's first output before the route
answers: the engine validates a request when its stream is first read, so a
refused request (``RequestError``) is still a plain 400 rather than an error
inside an already-started 200 stream. That wait, and ``collect``'s, end as soon
as the client leaves (``client_watch``): a request queued behind others is then
dropped from the queue before it is prefilled, a running one before its next
step. ``Generation`` then yields the outputs, records the finished request's
latencies, and closes the engine's stream in every case — closing it early is
what aborts the request and frees its pages. The request's id is held
(``ServerState.claim_rid``) from submission until the stream is closed.
A draining worker (``server/drain.py``) refuses new requests here: 503, ``Retry-After: 0``.
``first_token_s`` is when the first generated token reached the server, in
seconds after arrival (SGLang's ``ttft``, known from the first streamed chunk on).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hicache.engine.api import GenerateOutput, GenerateRequest, RequestError, TokenLogprob
from hicache.server.access_log import record_output
from hicache.server.client_watch import ClientWatch, until_client_leaves
from hicache.server.drain import REFUSAL
from hicache.server.errors import APIError
from hicache.server.state import ServerState


@dataclass(frozen=True)
class Completed:
    """A whole request: its text, its tokens and the engine's last output (usage, reason)."""

    text: str
    token_ids: tuple[int, ...]
    last: GenerateOutput
    output_logprobs: tuple[TokenLogprob, ...] = ()
    input_logprobs: tuple[TokenLogprob, ...] = ()

    def whole(self) -> GenerateOutput:
        """The request's outputs as one (its text decoded in one go)."""
        return dataclasses.replace(
            self.last, token_ids=self.token_ids, text=self.text,
            output_logprobs=self.output_logprobs, input_logprobs=self.input_logprobs,
        )


class Generation:
    def __init__(
        self, state: ServerState, stream: AsyncIterator[GenerateOutput], first: GenerateOutput,
        started: float, rid: str, log_metrics: bool = True,
    ) -> None:
        self._state = state
        self._stream = stream
        self._first: GenerateOutput | None = first
        self._rid: str | None = rid
        self._log_metrics = log_metrics
        self.started = started  # time.monotonic() at arrival
        self.first_token_s: float | None = None

    async def __aiter__(self) -> AsyncIterator[GenerateOutput]:
        try:
            if self._first is not None:
                output, self._first = self._first, None
                self._finish(output)
                yield output
                if output.finished:
                    return
            async for output in self._stream:
                self._finish(output)
                yield output
                if output.finished:
                    return
        finally:
            await self.aclose()

    def _finish(self, output: GenerateOutput) -> None:
        if self.first_token_s is None and output.token_ids:
            self.first_token_s = time.monotonic() - self.started
        if output.finished:
            record_output(output)  # the access log's token counts
            if self._log_metrics:
                self._state.metrics.observe(output)

    async def aclose(self) -> None:
        """Stop reading; the engine aborts the request if it has not finished."""
        try:
            close = getattr(self._stream, "aclose", None)
            if close is not None:
                await close()
        finally:
            if self._rid is not None:
                self._state.release_rid(self._rid)
                self._rid = None

    async def collect(self, watch: ClientWatch | None = None) -> Completed:
        """Read to the end; a request the engine failed is an APIError(500).

        With ``watch``, a client that goes away before the answer is ready aborts the
        request (``ClientGone``, a 499): its pages are freed before its next step
        instead of computing tokens nobody will read.
        """
        return await until_client_leaves(self._read_all(), watch)

    async def _read_all(self) -> Completed:
        texts: list[str] = []
        tokens: list[int] = []
        output_logprobs: list[TokenLogprob] = []
        input_logprobs: list[TokenLogprob] = []
        last: GenerateOutput | None = None
        async for output in self:
            texts.append(output.text)
            tokens.extend(output.token_ids)
            output_logprobs.extend(output.output_logprobs)
            input_logprobs.extend(output.input_logprobs)
            last = output
        if last is None or not last.finished:
            raise APIError(500, "the engine ended the request without a final output")
        if last.error is not None:
            raise APIError(500, f"the engine failed the request: {last.error}")
        return Completed("".join(texts), tuple(tokens), last, tuple(output_logprobs),
                         tuple(input_logprobs))


async def start_generation(
    state: ServerState, request: GenerateRequest, log_metrics: bool = True,
    watch: ClientWatch | None = None,
) -> Generation:
    """Submit ``request`` (its rid set) and wait for its first output; RequestError
    becomes a 400, a rid already in flight too. With ``watch``, a client that leaves
    meanwhile ends the wait (``ClientGone``) and the engine drops the request."""
    started = time.monotonic()
    if state.draining:  # a router retries elsewhere at once
        raise APIError(503, REFUSAL, headers={"Retry-After": "0"})
    state.claim_rid(request.rid)
    stream = state.engine.generate(request)
    try:
        first = await until_client_leaves(anext(stream), watch)
    except BaseException as error:
        try:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        finally:
            state.release_rid(request.rid)
        if isinstance(error, RequestError):
            raise APIError(400, str(error)) from None
        if isinstance(error, StopAsyncIteration):
            raise APIError(500, "the engine returned no output") from None
        if isinstance(error, RuntimeError):  # the engine is not running (shutting down)
            raise APIError(503, str(error)) from None
        raise
    return Generation(state, stream, first, started, request.rid, log_metrics)
