"""StorageController: the threads that talk to L3, so the scheduler thread never does.

Three threads per attached backend, so that one kind of traffic never waits
behind another:
- the *query* thread answers prefetch lookups (how far a request's page chain
  continues in L3: batched ``exists``);
- the *read* thread runs prefetch reads (L3 -> freshly allocated host pages);
- the *write* thread runs backups (host pages -> L3; ``set`` skips the pages
  L3 already has, so no ``exists`` pass precedes it), discards, and pins
  (``pin``/``unpin``: queued behind the backups submitted before them, so a pin
  of pages being backed up lands once they are stored; nobody waits for them),
  and tenant purges (``purge_tenant``: behind the backups queued before it, its
  caller waiting up to its own deadline); after each backup, discard and purge it
  notes the backend's bytes per tenant, which ``tenant_usage`` answers from.

Every backend call has a deadline (``io_timeout_s``). Each thread hands its
calls to a runner thread (``DeadlineCaller``) and waits at most that long; a
call that has not returned by then is *stalled*: it counts as failed (reason
"timeout"), opens the circuit breaker at once (a store that hangs is down),
and the thread moves on. The stalled call may still write into (``get``) or
read from (``set``) its host pages whenever it returns, so those pages are
reported (``("stalled", call)``) and must not be reused until it returns
(``("returned", call)``). At most ``MAX_STALLED_CALLS`` calls may be stalled
at once; past that, calls are refused until one returns.

The scheduler thread submits operations and collects finished ones and stall
reports with ``poll()``; it alone touches the tree and the allocators. Every
backend call goes through the circuit breaker, and any exception from a
backend is a miss.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.openmp import one_openmp_thread_here
from hicache.radix.results import no_pages
from hicache.storage.base import MAX_BATCH_PAGES, StorageBackend, StorageError, StorageStats
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.call_tenant import call_tenant
from hicache.storage.deadline import Call, DeadlineCaller
from hicache.storage.failure_log import FailureLog
from hicache.storage.failure_reasons import FailureReason, raised_reason

logger = logging.getLogger(__name__)

# Failure reasons in backend stats that mean "the store is not answering" (as
# opposed to a miss or one bad object): they feed the circuit breaker.
OUTAGE_REASONS = (FailureReason.UNREACHABLE, FailureReason.IO_ERROR, FailureReason.TIMEOUT)
# Calls that may be stalled (past their deadline, still running) at once. The
# breaker already spaces calls to a stalled store (one trial per backoff); this
# hard cap bounds the threads and host pages a store that never answers can hold.
MAX_STALLED_CALLS = 8


@dataclass(eq=False)
class PrefetchOp:
    """One request's lookup and read of its page chain from L3.

    Written by the threads: ``num_existing`` (query thread, before posting),
    ``num_landed`` (read thread; only grows, one whole batch at a time, so any
    value read is a verified prefix of ``host_pages``), ``num_claimed`` (read
    thread, under the op's lock: pages it has handed to a ``get``),
    ``read_seconds`` (read thread: the time the read of the landed pages took)
    and ``io_done``; ``queried`` is set once the lookup's answer is in ``poll``,
    ``read`` once the read's end is.
    """

    keys: list[bytes]
    cancelled: threading.Event = field(default_factory=threading.Event)
    queried: threading.Event = field(default_factory=threading.Event)
    read: threading.Event = field(default_factory=threading.Event)
    num_existing: int = -1
    host_pages: PageIds | None = None
    num_landed: int = 0
    read_seconds: float = 0.0
    num_claimed: int = 0
    io_done: bool = False
    owner: Any = None  # the scheduler's handle
    tenant: str | None = None  # the request's cache salt (storage/call_tenant.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self, stop: int) -> bool:
        """Read thread: may pages [.., stop) go to a ``get``? False once cancelled."""
        with self._lock:
            if self.cancelled.is_set():
                return False
            self.num_claimed = stop
            return True

    def cancel(self) -> int:
        """Stop the op; returns how many leading host pages a ``get`` may still touch.

        Pages past the returned count are never handed to the backend from now
        on: the caller may free them at once.
        """
        with self._lock:
            self.cancelled.set()
            return self.num_claimed


@dataclass(eq=False)
class BackupOp:
    """Copy host pages to L3 under their page keys (``set`` skips what L3 has)."""

    keys: list[bytes]
    host_pages: PageIds
    owner: Any = None  # the scheduler's tree node
    num_stored: int = 0
    num_existing: int = 0
    tenant: str | None = None  # the node's cache salt (storage/call_tenant.py)


@dataclass(eq=False)
class DiscardOp:
    """Drop pages from L3 that the cache found damaged after reading them."""

    keys: list[bytes]


@dataclass(eq=False)
class PinOp:
    """Pin ``keys`` in L3 until ``until_unix_s``, or unpin them when it is None. Fire and
    forget: ``poll`` never reports it; its outcome is in the metrics."""

    keys: list[bytes]
    until_unix_s: float | None


@dataclass(eq=False)
class PurgeOp:
    """Remove a tenant's pages from L3 (``backend.purge_tenant``), on the write thread,
    before ``deadline`` (monotonic seconds). ``done`` is set once it is over: then
    ``removed`` is the objects removed, or ``error`` says why not."""

    tenant: str | None
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    removed: int = 0
    error: str | None = None
    # The backend's purge outran the deadline and goes on (``error`` says so too).
    late: bool = False


@dataclass(eq=False)
class StalledCall:
    """A backend call that missed its deadline and still runs (a thread cannot be stopped).

    Until ``poll`` reports it "returned", it may still write (``get``) or read
    (``set``) ``host_pages``: nobody else may be given them.
    """

    what: str  # "exists" | "get" | "set"
    host_pages: PageIds
    op: PrefetchOp | BackupOp | None
    began_s: float


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
    pin_pages: int = 0  # pages pinned in L3 (each pin call's pages)
    unpin_pages: int = 0
    pin_pages_failed: int = 0  # pages a pin or unpin did not reach
    # Gauges: calls past their deadline that have not returned, and the host pages they hold.
    stalled_calls: int = 0
    stalled_host_pages: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: FailureReason, count: int = 1) -> None:
        self._add(reason.value, count)

    def _add(self, reason: str, count: int) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + count

    @classmethod
    def total(cls, parts: Sequence[StorageMetrics]) -> StorageMetrics:
        """Field by field sums, failures by reason (the stores of a tensor-parallel
        group's ranks: each holds its own KV shard)."""
        out = cls()
        for part in parts:
            for f in fields(cls):
                if f.name != "failures":
                    setattr(out, f.name, getattr(out, f.name) + getattr(part, f.name))
            for reason, count in part.failures.items():
                out._add(reason, count)
        return out


@dataclass(frozen=True)
class _Answer:
    """What one backend call gave: a prefix count, and pages ``set`` found already stored."""

    count: int = 0
    num_skipped_existing: int = 0


_STOP = object()
_Event = tuple[str, "PrefetchOp | BackupOp | DiscardOp | StalledCall"]


class StorageController:
    def __init__(
        self, backend: StorageBackend, breaker: CircuitBreaker, io_timeout_s: float = 10.0
    ) -> None:
        self.backend = backend
        self.breaker = breaker
        self.io_timeout_s = io_timeout_s  # read at each call: re-attaching may change it
        self.metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()
        self.failure_log = FailureLog(backend.name)
        self._backend_failures: dict[str, int] = {}
        self._query_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._callers = {
            name: DeadlineCaller(f"hicache-l3-{name}", self._on_late_return)
            for name in ("query", "read", "write")
        }
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._outstanding = 0
        # The backend's bytes per tenant as last asked (write thread), for
        # ``tenant_usage``; None: not known (yet, or the backend cannot tell).
        self._tenant_usage: dict[str | None, int] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._threads:
            return
        self._stopping.clear()
        loops = (
            ("query", self._query_loop), ("read", self._read_loop), ("write", self._write_loop)
        )
        for name, target in loops:
            thread = threading.Thread(
                target=_on_one_openmp_thread, args=(target,), name=f"hicache-l3-{name}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Finish the operation each thread is in, cancel the queued ones, join.

        A call in flight ends by its deadline at the latest. Cancelled
        operations are still reported by ``poll`` (with nothing landed), so the
        scheduler can free what they held; stalled calls are reported
        "returned" by ``poll`` whenever they return, after ``stop`` too.
        """
        if not self._threads:
            return
        self._stopping.set()
        for q in (self._query_q, self._read_q, self._write_q):
            q.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.failure_log.flush()
        for caller in self._callers.values():
            caller.close()

    @property
    def running(self) -> bool:
        return bool(self._threads)

    # --------------------------------------------------------------- submit
    def submit_query(self, op: PrefetchOp) -> None:
        self._begin()
        self._query_q.put(op)

    def wait_queried(self, op: PrefetchOp, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``op``'s lookup; True once ``poll`` has its answer."""
        return op.queried.wait(timeout_s)

    def wait_read(self, op: PrefetchOp, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``op``'s read to end; True once ``poll`` has it."""
        return op.read.wait(timeout_s)

    def submit_load(self, op: PrefetchOp) -> None:
        assert op.host_pages is not None and len(op.host_pages) <= op.num_existing
        self._begin()
        self._read_q.put(op)

    def submit_backup(self, op: BackupOp) -> None:
        self._begin()
        self._write_q.put(op)

    def submit_discard(self, op: DiscardOp) -> None:
        self._begin()
        self._write_q.put(op)

    @property
    def supports_pins(self) -> bool:
        """Can L3 pin pages (``StorageBackend.supports_pins``)?"""
        return bool(self.backend.supports_pins)

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> None:
        """Queue a pin of ``keys`` until ``until_unix_s`` (wall clock) on the write thread;
        never blocks. Raises StorageError for misuse only: a backend that cannot pin, or
        an expiry that is not a finite time."""
        if not self.supports_pins:
            raise StorageError(f"L3 ({self.backend.name}) cannot pin pages")
        if isinstance(until_unix_s, bool) or not isinstance(until_unix_s, int | float) \
                or not math.isfinite(until_unix_s):
            raise StorageError(f"a pin's expiry is unix seconds, got {until_unix_s!r}")
        self._submit_pin(PinOp(list(keys), float(until_unix_s)))

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Queue the removal of ``keys``' pins on the write thread; never blocks."""
        if self.supports_pins:
            self._submit_pin(PinOp(list(keys), None))

    def _submit_pin(self, op: PinOp) -> None:
        if op.keys:
            self._begin()
            self._write_q.put(op)

    def poll(self) -> list[_Event]:
        """Finished operations: ("queried" | "loaded", PrefetchOp), ("backed_up", BackupOp);
        and stall reports: ("stalled" | "returned", StalledCall).

        A call's "stalled" comes before its "returned" and before its op's event.
        """
        events: list[_Event] = []
        while True:
            try:
                events.append(self._done.get_nowait())
            except queue.Empty:
                return events

    def clear_store(self, timeout_s: float) -> None:
        """Remove every page of the store (``backend.clear``), once no call is in flight,
        within ``timeout_s``; StorageError when it could not (busy, failed, too slow: an
        abandoned clear goes on in the background and logs its end)."""
        if not self.wait_idle(timeout_s):
            raise StorageError("L3 calls are still in flight: clear it again in a moment")

        def late(call: Call) -> None:
            outcome = "failed" if call.error is not None else "finished"
            logger.warning("L3 (%s) clear %s after its deadline", self.backend.name, outcome)

        clearing = DeadlineCaller("hicache-l3-clear", late)
        try:
            call = clearing.run(self.backend.clear, timeout_s, lambda call: None)
        finally:
            clearing.close()
        if call.abandoned:
            raise StorageError(f"clearing L3 ({self.backend.name}) did not finish in "
                               f"{timeout_s:g} s; it goes on in the background")
        if call.error is not None:
            raise StorageError(f"clearing L3 ({self.backend.name}) failed: "
                               f"{type(call.error).__name__}: {call.error}")
        logger.info("L3 (%s) cleared", self.backend.name)

    def tenant_usage(self) -> dict[str | None, int] | None:
        """L3 bytes per tenant as last known (refreshed by the write thread after each
        backup, discard and purge); never blocks on the store. None: not known."""
        with self._metrics_lock:
            return None if self._tenant_usage is None else dict(self._tenant_usage)

    def purge_tenant(self, tenant: str | None, timeout_s: float) -> int:
        """Remove ``tenant``'s pages from L3 (``backend.purge_tenant``) on the write
        thread, after the writes queued before it, within ``timeout_s``; returns the
        objects removed. StorageError when it could not: the backend cannot list a
        tenant's pages, it failed, or it did not finish in time (an abandoned purge
        goes on in the background and logs its end)."""
        return self.wait_purge(self.submit_purge(tenant, timeout_s), timeout_s)

    def submit_purge(self, tenant: str | None, timeout_s: float) -> PurgeOp:
        """Queue the purge of ``purge_tenant`` and return at once (the scheduler thread's
        half: it must not wait on the store); ``wait_purge`` waits for it elsewhere."""
        if not self.running:
            raise StorageError("L3 is not running: nothing to purge")
        op = PurgeOp(tenant, time.monotonic() + timeout_s)
        self._begin()
        self._write_q.put(op)
        return op

    def wait_purge(self, op: PurgeOp, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for ``op`` (``submit_purge``): the objects removed, or
        StorageError as ``purge_tenant`` says."""
        # The write thread may see the deadline pass before this wait does: one message.
        if not op.done.wait(timeout_s) or op.late:
            raise StorageError(f"purging a tenant from L3 ({self.backend.name}) did not "
                               f"finish in {timeout_s:g} s; it goes on in the background")
        if op.error is not None:
            raise StorageError(op.error)
        return op.removed

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted operation has finished (tests, detach, shutdown).

        Stalled calls do not count: their operations finished at the deadline.
        """
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    @property
    def num_outstanding(self) -> int:
        with self._idle:
            return self._outstanding

    @property
    def num_stalled_calls(self) -> int:
        with self._metrics_lock:
            return self.metrics.stalled_calls

    # -------------------------------------------------------------- threads
    def _query_loop(self) -> None:
        while True:
            op = self._query_q.get()
            if op is _STOP:
                self._drain(self._query_q)
                return
            assert isinstance(op, PrefetchOp)
            op.num_existing = 0 if self._stopping.is_set() else self._lookup(op)
            self._finish(("queried", op))

    def _read_loop(self) -> None:
        while True:
            op = self._read_q.get()
            if op is _STOP:
                self._drain(self._read_q)
                return
            assert isinstance(op, PrefetchOp)
            if not self._stopping.is_set():
                self._read(op)
            op.io_done = True
            self._finish(("loaded", op))

    def _write_loop(self) -> None:
        self._refresh_tenant_usage()
        while True:
            op = self._write_q.get()
            if op is _STOP:
                self._drain(self._write_q)
                return
            if isinstance(op, DiscardOp):
                if not self._stopping.is_set():
                    self._call("write", "discard", self.backend.discard, op.keys)
                self._refresh_tenant_usage()
                self._finish(("discarded", op))
                continue
            if isinstance(op, PinOp):
                self._pin(op)
                self._finish(None)
                continue
            if isinstance(op, PurgeOp):
                self._purge(op)
                self._refresh_tenant_usage()
                self._finish(None)
                continue
            assert isinstance(op, BackupOp)
            if not self._stopping.is_set():
                self._write(op)
            else:
                self._note_backup_failed(op, FailureReason.DETACHED)
            self._refresh_tenant_usage()
            self._finish(("backed_up", op))

    def _refresh_tenant_usage(self) -> None:
        """Write thread: ask the backend its bytes per tenant (from its memory: cheap)."""
        try:
            usage = self.backend.tenant_usage()
        except Exception as error:  # a backend that fails here is only not reported
            logger.warning("L3 (%s) tenant usage failed: %s", self.backend.name, error)
            usage = None
        with self._metrics_lock:
            self._tenant_usage = usage

    def _purge(self, op: PurgeOp) -> None:
        """Write thread: run ``op`` within what is left of its deadline."""
        if self._stopping.is_set():
            op.error = "L3 is being detached: nothing purged"
            op.done.set()
            return
        remaining = op.deadline - time.monotonic()
        if remaining <= 0:
            op.error = "the purge waited past its deadline behind other L3 writes"
            op.done.set()
            return
        name = self.backend.name

        def late(call: Call) -> None:
            outcome = "failed" if call.error is not None else "finished"
            logger.warning("L3 (%s) purge of a tenant %s after its deadline", name, outcome)

        purging = DeadlineCaller("hicache-l3-purge", late)
        try:
            call = purging.run(
                lambda: self.backend.purge_tenant(op.tenant), remaining, lambda call: None
            )
        finally:
            purging.close()
        if call.abandoned:
            op.late = True
            op.error = (f"purging a tenant from L3 ({name}) did not finish in time; "
                        "it goes on in the background")
        elif call.error is not None:
            op.error = (call.error.args[0] if isinstance(call.error, StorageError)
                        else f"purging a tenant from L3 ({name}) failed: "
                             f"{type(call.error).__name__}: {call.error}")
        else:
            op.removed = int(call.value)
            logger.info("L3 (%s): purged %d objects of a tenant", name, op.removed)
        op.done.set()

    def _drain(self, q: queue.SimpleQueue[Any]) -> None:
        """Report every queued operation as finished with nothing done (stopping)."""
        while True:
            try:
                op = q.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, DiscardOp):
                self._finish(("discarded", op))
            elif isinstance(op, PinOp):
                self._note_pin_failed(op, FailureReason.DETACHED)
                self._finish(None)
            elif isinstance(op, PurgeOp):
                op.error = "L3 is being detached: nothing purged"
                op.done.set()
                self._finish(None)
            elif isinstance(op, BackupOp):
                self._note_backup_failed(op, FailureReason.DETACHED)
                self._finish(("backed_up", op))
            elif isinstance(op, PrefetchOp):
                if q is self._query_q:
                    op.num_existing = 0
                    self._finish(("queried", op))
                else:
                    op.io_done = True
                    self._finish(("loaded", op))

    # ----------------------------------------------------------- operations
    def _lookup(self, op: PrefetchOp) -> int:
        found = 0
        for start in range(0, len(op.keys), MAX_BATCH_PAGES):
            if op.cancelled.is_set():
                break
            batch = op.keys[start : start + MAX_BATCH_PAGES]
            n = self._call("query", "exists", self.backend.exists, batch, op=op).count
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
            stop = min(len(op.host_pages), start + MAX_BATCH_PAGES)
            if not op.claim(stop):  # cancelled: pages past here may already be freed
                break
            n = self._call(
                "read", "get", self.backend.get, op.keys[start:stop], op.host_pages[start:stop], op
            ).count
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
        # One set per batch: set skips pages L3 already has (another instance wrote
        # them) and counts them as stored; its stats say how many it skipped.
        stored = existing = 0
        for start in range(0, len(keys), MAX_BATCH_PAGES):
            stop = min(len(keys), start + MAX_BATCH_PAGES)
            answer = self._call("write", "set", self.backend.set, keys[start:stop],
                                pages[start:stop], op)
            stored += answer.count
            existing += min(answer.count, answer.num_skipped_existing)
            if answer.count < stop - start:
                break
        op.num_stored = stored
        op.num_existing = existing
        with self._metrics_lock:
            self.metrics.backup_pages_existing += existing
            self.metrics.backup_pages_stored += stored - existing
            self.metrics.backup_pages_failed += len(keys) - stored
            self.metrics.backup_seconds += time.perf_counter() - began

    def _pin(self, op: PinOp) -> None:
        """Pin or unpin ``op``'s keys, batch by batch; pages not reached count as failed."""
        if self._stopping.is_set():
            self._note_pin_failed(op, FailureReason.DETACHED)
            return
        until = op.until_unix_s
        what = "unpin" if until is None else "pin"
        done = 0
        for start in range(0, len(op.keys), MAX_BATCH_PAGES):
            batch = op.keys[start : start + MAX_BATCH_PAGES]
            if until is None:
                n = self._call("write", what, self.backend.unpin, batch).count
            else:
                pin_until = functools.partial(self.backend.pin, until_unix_s=until)
                n = self._call("write", what, pin_until, batch).count
            done += n
            if until is not None and n < len(batch):
                break  # a pin stops at its first failure (the backend counted why)
        with self._metrics_lock:
            if until is None:
                self.metrics.unpin_pages += done
            else:
                self.metrics.pin_pages += done
                self.metrics.pin_pages_failed += len(op.keys) - done

    def _note_pin_failed(self, op: PinOp, reason: FailureReason) -> None:
        with self._metrics_lock:
            self.metrics.pin_pages_failed += len(op.keys)
            self.metrics.fail(reason, len(op.keys))

    def _note_backup_failed(self, op: BackupOp, reason: FailureReason) -> None:
        with self._metrics_lock:
            self.metrics.backup_pages_failed += len(op.keys)
            self.metrics.fail(reason, len(op.keys))

    # ------------------------------------------------------- backend calls
    def _call(
        self, thread: str, what: str, fn: Callable[..., int], keys: list[bytes],
        host_pages: PageIds | None = None, op: PrefetchOp | BackupOp | None = None,
    ) -> _Answer:
        """One backend call through the breaker, within the deadline; any failure is 0 pages."""
        with self._metrics_lock:
            if self.metrics.stalled_calls >= MAX_STALLED_CALLS:
                self.metrics.fail(FailureReason.STALLED_LIMIT)
                return _Answer()
        if not self.breaker.allow():
            with self._metrics_lock:
                self.metrics.fail(FailureReason.BREAKER_OPEN)
            return _Answer()
        args: tuple[Any, ...] = (keys,) if host_pages is None else (keys, host_pages)
        pages = no_pages() if host_pages is None else np.asarray(host_pages).copy()
        tenant = None if op is None else op.tenant
        call = self._callers[thread].run(
            lambda: self._measured(fn, args, tenant), self.io_timeout_s,
            lambda late: self._on_stall(late, what, pages, op),
        )
        if call.abandoned:
            self.breaker.trip(f"{what} gave no answer in {self.io_timeout_s:g} s")
            return _Answer()
        if call.error is not None:
            error = call.error
            logger.warning("L3 %s failed: %s: %s", what, type(error).__name__, error)
            with self._metrics_lock:
                self.metrics.fail(raised_reason(what))
            self.breaker.record_failure(f"{what} raised {type(error).__name__}")
            return _Answer()
        answer, outage = call.value
        if outage:
            self.breaker.record_failure(f"{what} reported the store unreachable")
        else:
            self.breaker.record_success()
        return _Answer(max(0, min(answer.count, len(keys))), answer.num_skipped_existing)

    def _measured(
        self, fn: Callable[..., int], args: tuple[Any, ...], tenant: str | None = None,
    ) -> tuple[_Answer, bool]:
        """Runs on the runner: the call (for ``tenant``: ``call_tenant.py``), and whether
        the backend counted an outage meanwhile.

        The stats are read here, not on the waiting thread: a backend whose call
        hangs may hold the lock its ``stats()`` takes.
        """
        before = self._stats()
        with call_tenant(tenant):
            count = int(fn(*args))
        after = self._stats()
        if before is None or after is None:
            return _Answer(count), False
        with self._metrics_lock:
            self._backend_failures = dict(after.failures)
        self.failure_log.observe("backend", after.failures)
        skipped = after.pages_skipped_existing - before.pages_skipped_existing
        return _Answer(count, max(0, skipped)), _outages(after) > _outages(before)

    def _stats(self) -> StorageStats | None:
        try:
            return self.backend.stats()
        except Exception:  # a backend whose stats fail is judged by its calls alone
            return None

    def _on_stall(
        self, call: Call, what: str, pages: PageIds, op: PrefetchOp | BackupOp | None
    ) -> StalledCall:
        """The call missed its deadline (waiting thread, under the caller's lock)."""
        stalled = StalledCall(what, pages, op, call.began_s)
        with self._metrics_lock:
            self.metrics.fail(FailureReason.TIMEOUT)
            self.metrics.stalled_calls += 1
            self.metrics.stalled_host_pages += len(pages)
            num_stalled = self.metrics.stalled_calls
        logger.warning(
            "L3 (%s) %s stalled: no answer in %.1f s; treating L3 as down and moving on. "
            "Its %d host pages stay reserved until it returns (stalled calls now: %d)",
            self.backend.name, what, time.monotonic() - call.began_s, len(pages), num_stalled,
        )
        self._done.put(("stalled", stalled))
        return stalled

    def _on_late_return(self, call: Call) -> None:
        """A stalled call returned (its runner thread, under the caller's lock)."""
        stalled = call.context
        assert isinstance(stalled, StalledCall)
        with self._metrics_lock:
            self.metrics.stalled_calls -= 1
            self.metrics.stalled_host_pages -= len(stalled.host_pages)
        logger.info(
            "L3 (%s) answered again: a %s stalled for %.1f s returned; its %d host pages "
            "are released", self.backend.name, stalled.what,
            time.monotonic() - stalled.began_s, len(stalled.host_pages),
        )
        self._done.put(("returned", stalled))

    def backend_failures(self) -> dict[str, int]:
        """The backend's failure counts by reason, as of its last call that returned.

        Read from the copy the runner threads keep, never from the backend: a
        backend whose call hangs may hold the lock its ``stats()`` takes.
        """
        with self._metrics_lock:
            return dict(self._backend_failures)

    # ---------------------------------------------------------- bookkeeping
    def _begin(self) -> None:
        with self._idle:
            self._outstanding += 1

    def _finish(self, event: _Event | None) -> None:
        """An operation is done: report ``event`` to ``poll`` (None: nothing to report)."""
        # The backend's own reasons reach the log from the runner threads (``_measured``).
        with self._metrics_lock:
            failures = dict(self.metrics.failures)
        self.failure_log.observe("controller", failures)
        if event is not None:
            self._done.put(event)
            kind, op = event
            if kind == "queried":  # after the put: a waiter's poll finds the answer
                assert isinstance(op, PrefetchOp)
                op.queried.set()
            elif kind == "loaded":
                assert isinstance(op, PrefetchOp)
                op.read.set()
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def snapshot(self) -> StorageMetrics:
        with self._metrics_lock:
            copy = StorageMetrics(**{k: v for k, v in vars(self.metrics).items()})
            copy.failures = dict(self.metrics.failures)
            return copy


def _outages(stats: StorageStats) -> int:
    return sum(stats.failures.get(reason.value, 0) for reason in OUTAGE_REASONS)


def _on_one_openmp_thread(loop: Callable[[], None]) -> None:
    """Run a storage loop with its torch ops on its own thread only (``hicache.openmp``)."""
    one_openmp_thread_here()
    loop()

