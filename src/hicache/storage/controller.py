"""StorageController: the threads that talk to L3, so the scheduler thread never does.

Two threads per attached backend:
- the *query* thread answers prefetch lookups (how far a request's page chain
  continues in L3: batched ``exists``);
- the *io* thread moves data: prefetch reads (L3 -> freshly allocated host
  pages) before backups (host pages -> L3, skipping pages L3 already has).

The scheduler thread submits operations and collects finished ones with
``poll()``; it alone touches the tree and the allocators. Every backend call
goes through a circuit breaker, and any exception from a backend is a miss.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache.memory.allocator import PageIds
from hicache.storage.base import MAX_BATCH_PAGES, StorageBackend
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.failure_log import FailureLog

logger = logging.getLogger(__name__)

# Failure reasons in backend stats that mean "the store is not answering" (as
# opposed to a miss or one bad object): they feed the circuit breaker.
OUTAGE_REASONS = ("unreachable", "io_error", "timeout")


@dataclass(eq=False)
class PrefetchOp:
    """One request's lookup and read of its page chain from L3.

    Written by the threads: ``num_existing`` (query thread, before posting),
    ``num_landed`` (io thread; only grows, one whole batch at a time, so any
    value read is a verified prefix of ``host_pages``), ``read_seconds`` (io
    thread: the time the read of the landed pages took) and ``io_done``.
    """

    keys: list[bytes]
    cancelled: threading.Event = field(default_factory=threading.Event)
    num_existing: int = -1
    host_pages: PageIds | None = None
    num_landed: int = 0
    read_seconds: float = 0.0
    io_done: bool = False
    owner: Any = None  # the scheduler's handle


@dataclass(eq=False)
class BackupOp:
    """Copy host pages to L3 under their page keys (skipping what L3 has)."""

    keys: list[bytes]
    host_pages: PageIds
    owner: Any = None  # the scheduler's tree node
    num_stored: int = 0
    num_existing: int = 0


@dataclass
class StorageMetrics:
    prefetch_queries: int = 0
    prefetch_pages_found: int = 0
    prefetch_pages_loaded: int = 0
    prefetch_seconds: float = 0.0
    backup_pages_stored: int = 0
    backup_pages_existing: int = 0
    backup_pages_failed: int = 0
    backup_seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str, count: int = 1) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + count


_STOP = object()
_Event = tuple[str, "PrefetchOp | BackupOp"]


class StorageController:
    def __init__(self, backend: StorageBackend, breaker: CircuitBreaker) -> None:
        self.backend = backend
        self.breaker = breaker
        self.metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()
        self.failure_log = FailureLog(backend.name)
        self._query_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Prefetch reads (priority 0) go before backups (priority 1).
        self._io_q: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._done: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._outstanding = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._threads:
            return
        self._stopping.clear()
        for name, target in (("query", self._query_loop), ("io", self._io_loop)):
            thread = threading.Thread(target=target, name=f"hicache-l3-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Finish the operation each thread is in, cancel the queued ones, join.

        Cancelled operations are still reported by ``poll`` (with nothing
        landed), so the scheduler can free what they held.
        """
        if not self._threads:
            return
        self._stopping.set()
        self._query_q.put(_STOP)
        self._io_q.put((-1, next(self._seq), _STOP))
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.failure_log.flush()

    @property
    def running(self) -> bool:
        return bool(self._threads)

    # --------------------------------------------------------------- submit
    def submit_query(self, op: PrefetchOp) -> None:
        self._begin()
        self._query_q.put(op)

    def submit_load(self, op: PrefetchOp) -> None:
        assert op.host_pages is not None and len(op.host_pages) <= op.num_existing
        self._begin()
        self._io_q.put((0, next(self._seq), op))

    def submit_backup(self, op: BackupOp) -> None:
        self._begin()
        self._io_q.put((1, next(self._seq), op))

    def poll(self) -> list[_Event]:
        """Finished operations: ("queried" | "loaded", PrefetchOp) or ("backed_up", BackupOp)."""
        events: list[_Event] = []
        while True:
            try:
                events.append(self._done.get_nowait())
            except queue.Empty:
                return events

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted operation has finished (tests, detach, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    @property
    def num_outstanding(self) -> int:
        with self._idle:
            return self._outstanding

    # -------------------------------------------------------------- threads
    def _query_loop(self) -> None:
        while True:
            op = self._query_q.get()
            if op is _STOP:
                self._drain_query_queue()
                return
            assert isinstance(op, PrefetchOp)
            op.num_existing = 0 if self._stopping.is_set() else self._lookup(op)
            self._finish(("queried", op))

    def _drain_query_queue(self) -> None:
        while True:
            try:
                op = self._query_q.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, PrefetchOp):
                op.num_existing = 0
                self._finish(("queried", op))

    def _io_loop(self) -> None:
        while True:
            _, _, op = self._io_q.get()
            if op is _STOP:
                self._drain_io_queue()
                return
            if isinstance(op, PrefetchOp):
                if not self._stopping.is_set():
                    self._read(op)
                op.io_done = True
                self._finish(("loaded", op))
            else:
                if not self._stopping.is_set():
                    self._write(op)
                else:
                    self._note_backup_failed(op, "detached")
                self._finish(("backed_up", op))

    def _drain_io_queue(self) -> None:
        while True:
            try:
                _, _, op = self._io_q.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, PrefetchOp):
                op.io_done = True
                self._finish(("loaded", op))
            elif isinstance(op, BackupOp):
                self._note_backup_failed(op, "detached")
                self._finish(("backed_up", op))

    # ----------------------------------------------------------- operations
    def _lookup(self, op: PrefetchOp) -> int:
        found = 0
        for start in range(0, len(op.keys), MAX_BATCH_PAGES):
            if op.cancelled.is_set():
                break
            batch = op.keys[start : start + MAX_BATCH_PAGES]
            n = self._call("exists", self.backend.exists, batch)
            found += n
            if n < len(batch):
                break
        with self._metrics_lock:
            self.metrics.prefetch_queries += 1
            self.metrics.prefetch_pages_found += found
        return found

    def _read(self, op: PrefetchOp) -> None:
        assert op.host_pages is not None
        began = time.perf_counter()
        for start in range(0, len(op.host_pages), MAX_BATCH_PAGES):
            if op.cancelled.is_set():
                break
            stop = min(len(op.host_pages), start + MAX_BATCH_PAGES)
            n = self._call("get", self.backend.get, op.keys[start:stop], op.host_pages[start:stop])
            # Published only after the whole call returned: these pages are final.
            op.num_landed = start + n
            if n < stop - start:
                break
        op.read_seconds = time.perf_counter() - began
        with self._metrics_lock:
            self.metrics.prefetch_pages_loaded += op.num_landed
            self.metrics.prefetch_seconds += op.read_seconds

    def _write(self, op: BackupOp) -> None:
        began = time.perf_counter()
        keys, pages = op.keys, op.host_pages
        # Pages L3 already has (another instance wrote them) are not sent again.
        existing = 0
        for start in range(0, len(keys), MAX_BATCH_PAGES):
            batch = keys[start : start + MAX_BATCH_PAGES]
            n = self._call("exists", self.backend.exists, batch)
            existing += n
            if n < len(batch):
                break
        op.num_existing = existing
        stored = existing
        for start in range(existing, len(keys), MAX_BATCH_PAGES):
            stop = min(len(keys), start + MAX_BATCH_PAGES)
            n = self._call("set", self.backend.set, keys[start:stop], pages[start:stop])
            stored += n
            if n < stop - start:
                break
        op.num_stored = stored
        with self._metrics_lock:
            self.metrics.backup_pages_existing += existing
            self.metrics.backup_pages_stored += stored - existing
            self.metrics.backup_pages_failed += len(keys) - stored
            self.metrics.backup_seconds += time.perf_counter() - began

    def _note_backup_failed(self, op: BackupOp, reason: str) -> None:
        with self._metrics_lock:
            self.metrics.backup_pages_failed += len(op.keys)
            self.metrics.fail(reason, len(op.keys))

    def _call(self, what: str, fn: Callable[..., int], *args: Any) -> int:
        """One backend call through the breaker; any failure is 0 pages."""
        if not self.breaker.allow():
            with self._metrics_lock:
                self.metrics.fail("breaker_open")
            return 0
        before = self._outages()
        try:
            result = int(fn(*args))
        except Exception as error:
            logger.warning("L3 %s failed: %s: %s", what, type(error).__name__, error)
            with self._metrics_lock:
                self.metrics.fail(f"{what}_raised")
            self.breaker.record_failure(f"{what} raised {type(error).__name__}")
            return 0
        if self._outages() > before:
            self.breaker.record_failure(f"{what} reported the store unreachable")
        else:
            self.breaker.record_success()
        return max(0, min(result, len(args[0])))

    def _outages(self) -> int:
        failures = self.backend_failures()
        return sum(failures.get(reason, 0) for reason in OUTAGE_REASONS)

    def backend_failures(self) -> dict[str, int]:
        """The backend's failure counts by reason (its ``stats().failures``)."""
        try:
            return self.backend.stats().failures
        except Exception:  # a backend whose stats fail is judged by its calls alone
            return {}

    # ---------------------------------------------------------- bookkeeping
    def _begin(self) -> None:
        with self._idle:
            self._outstanding += 1

    def _finish(self, event: _Event) -> None:
        # Every backend call belongs to an operation: what it counted is final here.
        self.failure_log.observe("backend", self.backend_failures())
        with self._metrics_lock:
            failures = dict(self.metrics.failures)
        self.failure_log.observe("controller", failures)
        self._done.put(event)
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def snapshot(self) -> StorageMetrics:
        with self._metrics_lock:
            copy = StorageMetrics(**{k: v for k, v in vars(self.metrics).items()})
            copy.failures = dict(self.metrics.failures)
            return copy
