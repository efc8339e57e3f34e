"""Drain: a worker about to go away hands its KV to L3 and stops, losing no request.

Started by the first SIGTERM (``hicache serve``) or ``POST /hicache/drain`` (admin key),
once. From that moment the worker is *draining*: ``/health`` answers 503
``{"status": "draining"}``, ``/get_server_info`` has ``"draining": true`` and new
generation requests get a 503 saying to retry elsewhere, with ``Retry-After: 0`` (a
router stops sending here at once). Then, all bounded by one deadline
(``--drain-timeout-s`` after the start):

1. ``finishing``: the requests running or queued finish; those still in flight at the
   deadline are aborted with the error ``worker draining: deadline passed``;
2. ``writing``: every L1 and L2 page L3 lacks is written to L3, hottest first (the
   engine's ``drain_l3_step``, ``cache/drain.py``), the KV events of the stored pages
   published as any backup's; skipped without L3;
3. ``done``: ``on_done`` (``hicache serve`` stops the server; the process exits 0).

A second SIGTERM, or the deadline, ends it at once: the engine's shutdown lets a write
in flight end by its call deadline and drops the queued ones, and a store only makes a
page visible once it is whole, so what was stored stays stored and nothing half-written
is read. Progress is logged (start, requests left, pages written of those to write,
done) and exported (``DrainCollector``: ``hicache_drain_*``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

logger = logging.getLogger("hicache.drain")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEADLINE_ERROR = "worker draining: deadline passed"
REFUSAL = ("this worker is draining (shutting down) and takes no new requests: "
           "retry the request on another worker")
# How often the drain looks at what is left: a request's end or a page write is noticed
# within this, short beside any deadline an operator would give.
POLL_S = 0.05
# Progress lines at most this often while the count changes (start and end always).
LOG_EVERY_S = 1.0


class DrainPhase(enum.IntEnum):
    """The /metrics value of ``hicache_drain_state``."""

    SERVING = 0
    FINISHING = 1  # waiting for the requests in flight
    WRITING = 2  # writing what L3 lacks
    DONE = 3


class DrainEngine(Protocol):
    """What the drain uses of the engine (``Engine`` and ``EngineClient`` both have it)."""

    def is_idle(self) -> bool: ...

    def abort_all(self, message: str) -> int: ...

    def drain_l3_step(self) -> dict[str, Any]: ...

    def l3_lacking_pages(self) -> int: ...

    def storage_status(self) -> dict[str, Any]: ...


class Drainer:
    """The drain of one server (see the module docstring). ``rids_in_flight``: the
    server's requests whose answer is not out yet (the server's own set, read live)."""

    def __init__(
        self, engine: DrainEngine, rids_in_flight: Collection[str],
        timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        on_done: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {timeout_s}")
        self._engine = engine
        self._rids = rids_in_flight
        self.timeout_s = timeout_s
        self.on_done = on_done
        self._clock = clock
        self.phase = DrainPhase.SERVING
        self.reason: str | None = None
        self.deadline: float | None = None
        self.requests_left = 0
        self.requests_aborted = 0
        self.pages_to_write = 0
        self.pages_written = 0
        self.pages_existing = 0
        self.pages_skipped = 0
        self.l3_attached = False
        self.task: asyncio.Task[None] | None = None
        # The server's event loop (set when it starts): a signal handler schedules on it.
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def draining(self) -> bool:
        return self.phase is not DrainPhase.SERVING

    def seconds_left(self) -> float:
        return 0.0 if self.deadline is None else max(0.0, self.deadline - self._clock())

    async def begin(self, reason: str) -> dict[str, Any] | None:
        """Start draining, on the event loop; None when already draining. Returns what the
        drain will do: the requests to finish, the pages L3 lacks now, the deadline."""
        if self.draining:
            return None
        self.phase = DrainPhase.FINISHING  # at once: the contract holds from here
        self.reason = reason
        self.deadline = self._clock() + self.timeout_s
        try:
            status = await run_in_threadpool(self._engine.storage_status)
            attached = bool(status.get("attached"))
            lacking = await run_in_threadpool(self._engine.l3_lacking_pages) if attached else 0
        except Exception:  # an engine that cannot answer: the worker must still go away
            logger.exception("drain: the engine did not say what L3 lacks; writing nothing")
            attached, lacking = False, 0
        self.l3_attached = attached
        self.requests_left = len(self._rids)
        logger.info(
            "drain started (%s): %d requests in flight, %s; deadline in %.1f s", reason,
            self.requests_left,
            f"{lacking} L1/L2 pages L3 lacks to write" if attached else "no L3 attached",
            self.timeout_s,
        )
        self.task = asyncio.get_running_loop().create_task(self._run())
        return {
            "draining": True, "reason": reason, "deadline_s": self.timeout_s,
            "requests_in_flight": self.requests_left, "l3_attached": attached,
            "pages_l3_lacks": lacking,
        }

    def begin_soon(self, reason: str) -> bool:
        """From a signal handler (or another thread): schedule ``begin`` on the server's
        loop; False when no loop runs yet."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        loop.call_soon_threadsafe(lambda: loop.create_task(self.begin(reason)))
        return True

    async def _run(self) -> None:
        try:
            await self._finish_requests()
            await self._write_l3()
        except Exception:  # the worker must still exit: what was stored stays stored
            logger.exception("drain failed; stopping")
        self.phase = DrainPhase.DONE
        logger.info(
            "drain done: %d pages written to L3 (%d found there, %d skipped) of %d to write, "
            "%d requests aborted", self.pages_written, self.pages_existing, self.pages_skipped,
            self.pages_to_write, self.requests_aborted,
        )
        if self.on_done is not None:
            self.on_done()

    def _past_deadline(self) -> bool:
        return self.deadline is not None and self._clock() >= self.deadline

    async def _finish_requests(self) -> None:
        logged = self._clock()
        last_left = self.requests_left
        while True:
            idle = not self._rids and await run_in_threadpool(self._engine.is_idle)
            self.requests_left = len(self._rids)
            if idle:
                self.requests_left = 0
                return
            if self._past_deadline():
                break
            if self.requests_left != last_left and self._clock() - logged >= LOG_EVERY_S:
                logger.info("drain: %d requests left", self.requests_left)
                logged, last_left = self._clock(), self.requests_left
            await asyncio.sleep(POLL_S)
        self.requests_aborted = await run_in_threadpool(self._engine.abort_all, DEADLINE_ERROR)
        logger.warning(
            "drain: deadline passed with %d requests in flight: aborted (%s)",
            self.requests_left, DEADLINE_ERROR,
        )

    async def _write_l3(self) -> None:
        if not self.l3_attached or self._past_deadline():
            return
        self.phase = DrainPhase.WRITING
        logged = self._clock()
        while True:
            progress = await run_in_threadpool(self._engine.drain_l3_step)
            self.pages_to_write = int(progress["pages_to_write"])
            self.pages_written = int(progress["pages_written"])
            self.pages_existing = int(progress["pages_existing"])
            self.pages_skipped = int(progress["pages_skipped"])
            if progress["done"]:
                return
            if self._past_deadline():
                logger.warning(
                    "drain: deadline passed with %d of %d pages written to L3: the rest is "
                    "left out", self.pages_written, self.pages_to_write,
                )
                return
            if self._clock() - logged >= LOG_EVERY_S:
                logger.info("drain: %d of %d pages written to L3", self.pages_written,
                            self.pages_to_write)
                logged = self._clock()
            await asyncio.sleep(POLL_S)


class DrainCollector(Collector):
    """The drain's progress as ``hicache_drain_*`` series, read at scrape time."""

    def __init__(self, drainer: Drainer) -> None:
        self._drainer = drainer

    def collect(self) -> Iterator[Metric]:
        drain = self._drainer
        yield GaugeMetricFamily(
            "hicache_drain_state", "0 serving, 1 draining: finishing requests, 2 draining: "
            "writing to L3, 3 drained", value=float(drain.phase),
        )
        yield GaugeMetricFamily(
            "hicache_drain_seconds_left", "seconds until the drain's deadline (0 when not "
            "draining)", value=drain.seconds_left() if drain.draining else 0.0,
        )
        yield GaugeMetricFamily(
            "hicache_drain_requests_left", "requests the drain still waits for",
            value=float(drain.requests_left),
        )
        yield GaugeMetricFamily(
            "hicache_drain_pages_to_write", "L1/L2 pages the drain found L3 lacking",
            value=float(drain.pages_to_write),
        )
        for name, text, value in (
            ("pages_written", "pages the drain wrote to L3", drain.pages_written),
            ("pages_existing", "pages the drain found in L3 already", drain.pages_existing),
            ("pages_skipped", "pages the drain could not write", drain.pages_skipped),
            ("requests_aborted", "requests aborted at the drain's deadline",
             drain.requests_aborted),
        ):
            yield CounterMetricFamily(f"hicache_drain_{name}", text, value=float(value))
