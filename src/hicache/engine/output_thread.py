"""The output thread: detokenizing and handing outputs to the event loops, off the scheduler.

Per request per step, the scheduler thread only appends a record (the request, how
many tokens it has, whether it finished) to the step's list, and hands the list
over once per step (``flush``). This thread turns each record into a
``GenerateOutput``: it detokenizes the new tokens incrementally, holds back text
that may start a stop string, and delivers the step's outputs to each event loop
in one ``call_soon_threadsafe`` (every call wakes the loop's thread and takes its
lock, so once per request per step would be the largest cost of a big batch). Where
the outputs go is a request's ``OutputSink``: an event loop of this process
(``LoopSink``), or the pipe to the server's process when the engine runs in a
process of its own (``hicache.engine.engine_process``), likewise once per step.

Its Python work overlaps the scheduler's next forward, which runs with the GIL
released inside torch. Requests with stop strings are the exception: whether
they stop depends on their text, so the scheduler detokenizes them itself (as
before) and a record carries their text; this thread only streams it.

A detokenizer that fails fails its request alone: the caller gets a final output
with the error, and the scheduler is told to abort the request (``on_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hicache.engine.api import GenerateOutput, TokenLogprob

if TYPE_CHECKING:
    from hicache.engine.request import Req

logger = logging.getLogger(__name__)

# (request, its number of output tokens, finished, its text when the scheduler
# detokenizes it (stop strings) else None, the prompt's logprobs to send now,
# the scheduler's clock at the finish (0.0 before it)).
Record = tuple["Req", int, bool, "str | None", "tuple[TokenLogprob, ...]", float]
# (the stream's key in its sink, its output), for one sink.
Delivery = list[tuple[Any, GenerateOutput]]


class OutputSink(Protocol):
    """Where a step's outputs of some requests go, in one call per step."""

    def deliver(self, items: Delivery) -> None: ...


class LoopSink:
    """Outputs put on asyncio queues (a stream's key) of one event loop, one callback a step."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    # Sinks of one loop are one sink: a step's outputs for it go in one callback.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoopSink) and other.loop is self.loop

    def __hash__(self) -> int:
        return id(self.loop)

    def deliver(self, items: Delivery) -> None:
        # The caller's event loop may be gone already (asyncio.run returned right after
        # it abandoned the stream): nobody is left to read, so its outputs are dropped.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(put_all, items)


class Stream:
    """Where one request's outputs go, and how much of it was sent (output thread only)."""

    __slots__ = ("closed", "key", "num_chars", "num_ids", "sink")

    def __init__(self, sink: OutputSink, key: Any = None) -> None:
        self.sink = sink
        self.key = key  # what the sink tells this request's outputs by (LoopSink: its queue)
        self.num_ids = 0  # output tokens sent
        self.num_chars = 0  # characters of the scheduler's text sent (stop strings)
        self.closed = False  # its final output was sent


class OutputThread:
    def __init__(
        self, on_failure: Callable[[str], None] | None = None, threaded: bool = True
    ) -> None:
        # False: ``flush`` delivers on the caller's (the scheduler's) thread.
        self.threaded = threaded
        self._pending: list[Record] = []
        self._batches: queue.SimpleQueue[list[Record] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Told the rid of a request whose detokenizer failed (the engine aborts it).
        self.on_failure = on_failure
        self.cpu_seconds = 0.0  # the thread's CPU time so far (benchmarks read it)

    # -------------------------------------------------------- scheduler thread
    def add(self, req: Req, final: bool) -> None:
        """Record ``req``'s progress this step (its new tokens, or its end)."""
        input_logprobs: tuple[TokenLogprob, ...] = ()
        if req.request.logprobs is not None and not req.input_logprobs_sent and (
            final or not req.wants_input_logprobs
        ):
            input_logprobs = tuple(req.input_logprobs)
            req.input_logprobs_sent = True
        self._pending.append((
            req, len(req.output_ids), final, req.text if req.scheduler_text else None,
            input_logprobs, req.finished_at if final else 0.0,
        ))

    def flush(self) -> None:
        """Hand the step's records to the output thread."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if not self.threaded:
            self._deliver(pending)
            return
        self._start()
        self._batches.put(pending)

    def close(self) -> None:
        """Deliver what was flushed, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._batches.put(None)
            thread.join()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="hicache-output", daemon=True
                    )
                    self._thread.start()

    # ----------------------------------------------------------- its thread
    def _run(self) -> None:
        while True:
            batch = self._batches.get()
            if batch is None:
                return
            # Behind by several steps: deliver them together, in order.
            stop = False
            with contextlib.suppress(queue.Empty):
                while True:
                    more = self._batches.get_nowait()
                    if more is None:
                        stop = True
                        break
                    batch.extend(more)
            start = time.thread_time()
            try:
                self._deliver(batch)
            except Exception:  # never let the thread die: every later output would hang
                logger.exception("the output thread failed delivering a batch")
            self.cpu_seconds += time.thread_time() - start
            if stop:
                return

    def _deliver(self, batch: list[Record]) -> None:
        by_sink: dict[OutputSink, Delivery] = {}
        for record in batch:
            stream = record[0].stream
            if stream.closed:
                continue  # ended here already (its detokenizer failed)
            output = self._output(record, stream)
            items = by_sink.get(stream.sink)
            if items is None:
                items = by_sink[stream.sink] = []
            items.append((stream.key, output))
        for sink, items in by_sink.items():
            try:
                sink.deliver(items)
            except Exception:  # one sink's failure must not starve the others
                logger.exception("an output sink failed taking a step's outputs")

    def _output(self, record: Record, stream: Stream) -> GenerateOutput:
        req, num_ids, final, text, input_logprobs, finished_at = record
        new_ids = tuple(req.output_ids[stream.num_ids : num_ids])
        error = req.error if final else None
        reason = req.finish_reason if final else None
        try:
            delta = self._text(req, stream, new_ids, final, text)
        except Exception as failure:  # this request's fault alone
            logger.exception("request %s failed detokenizing its output", req.rid)
            final, reason, delta = True, "abort", ""
            error = f"internal error producing the next token: {type(failure).__name__}: " \
                f"{failure}"
            finished_at = time.monotonic()
            if self.on_failure is not None:
                self.on_failure(req.rid)
        output_logprobs: tuple[TokenLogprob, ...] = ()
        if req.request.logprobs is not None:
            output_logprobs = tuple(req.output_logprobs[stream.num_ids : num_ids])
        stream.num_ids = num_ids
        ttft = latency = None
        reuse = None
        if final:
            stream.closed = True
            latency = finished_at - req.arrived
            if req.first_token_at is not None:
                ttft = req.first_token_at - req.arrived
            if req.reuse_track is not None:
                reuse = req.reuse_track.final_report(req.first_token_at)
        return GenerateOutput(
            rid=req.rid, token_ids=new_ids, text=delta, finished=final,
            finish_reason=reason, prompt_tokens=req.prompt_len, completion_tokens=num_ids,
            cached_tokens=req.cached, ttft_s=ttft, latency_s=latency, error=error,
            output_logprobs=output_logprobs, input_logprobs=input_logprobs, reuse=reuse,
            hints=req.hint_outcomes if final else None,
        )

    @staticmethod
    def _text(
        req: Req, stream: Stream, new_ids: tuple[int, ...], final: bool, text: str | None
    ) -> str:
        if text is not None:
            # The scheduler's text (trimmed at a stop string): hold back what may be the
            # start of one until the text past it shows it is not.
            hold = 0 if final else max(len(s) for s in req.request.sampling.stop) - 1
            safe = max(stream.num_chars, len(text) - hold)
            delta = text[stream.num_chars : safe]
            stream.num_chars = safe
            return delta
        ids = new_ids
        if final and req.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the stop token ended it: not part of the text
        delta = req.detokenizer.push(ids) if ids else ""
        if final:
            delta += req.detokenizer.flush()
        return delta


class DroppedSink:
    """A sink that drops what it is given (a follower rank's requests' streams)."""

    def deliver(self, items: Delivery) -> None:
        return None


class DiscardedOutputs(OutputThread):
    """Records nothing and delivers nothing: a tensor-parallel follower rank's outputs
    (rank 0 streams every request; the followers only compute alongside)."""

    def __init__(self) -> None:
        super().__init__(on_failure=None, threaded=False)

    def add(self, req: Req, final: bool) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def put_all(items: Sequence[tuple[asyncio.Queue[GenerateOutput], GenerateOutput]]) -> None:
    """On the event loop: each output onto its queue."""
    for out, output in items:
        out.put_nowait(output)
