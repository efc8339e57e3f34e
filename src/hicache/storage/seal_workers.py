"""Threads that seal or open the pages of one L3 batch side by side.

AES-GCM (``cryptography``) releases the GIL while it encrypts or decrypts, so the
pages of a batch sealed or opened on N threads go at up to N times one core's rate
(about 10 GB/s a core with AES-NI): what lets a sealed page path keep up with a
plain one that moves pages at memory speed on one core. ``Sealer.workers`` is the
set a sealer's backends use (``storage.sealing``).

Invariants:
- At most ``workers`` threads, at most the cores this process may run on
  (``usable_cores``) and never more than ``MAX_SEAL_WORKERS``; with one worker no
  thread is made and every task runs inline on the caller: the serial path.
- ``ordered`` answers results in the order of its items, each task run for the
  tenant of the calling thread (``call_tenant``): a worker seals or opens with the
  caller's keys, never with another call's.
- ``ordered`` returns only once every task it started has finished: no worker
  touches a host page or a staging buffer after the call that lent it returned.
- A task that itself calls ``ordered`` (from a worker thread) runs its items inline,
  so the pool never waits on itself.
- A forked child makes its own threads (it inherits the executor, not its threads).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

from hicache.storage.call_tenant import call_tenant, current_tenant

# Past a few threads a batch is bound by memory bandwidth, not by AES.
MAX_SEAL_WORKERS = 4

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class SealWorkers:
    """A bounded thread pool running a batch's per-page tasks in order (thread-safe)."""

    def __init__(self, workers: int | None = None) -> None:
        wanted = usable_cores() if workers is None else workers
        self.workers = max(1, min(wanted, MAX_SEAL_WORKERS))
        self._executor: ThreadPoolExecutor | None = None
        self._owner = os.getpid()  # the process whose threads _executor runs
        self._lock = threading.Lock()
        self._inside = threading.local()  # set on this pool's worker threads

    def beside_copy(self) -> int:
        """Threads to seal or open with while another thread copies beside them (a store's
        memcpy of the part before): that copy keeps a core busy, so one fewer than the
        usable cores, at least one. On two cores two sealers beside a copy made three
        busy threads and measured slower than one (docs/benchmarks.md)."""
        return max(1, min(self.workers, usable_cores() - 1))

    def ordered(
        self, task: Callable[[T], R], items: Sequence[T], stop: Callable[[R], bool],
        threads: int | None = None,
    ) -> list[R]:
        """``task`` of each item, in order, ``threads`` (default ``workers``) at a time; no
        item is started past the first result ``stop`` says ends the batch. Returns the
        results of a prefix of ``items``: up to that one, and the tasks already running
        beside it (they are waited for, their results kept: the caller knows what they
        did). One thread runs every item on the calling thread."""
        width = self.workers if threads is None else max(1, min(threads, self.workers))
        if width == 1 or len(items) < 2 or getattr(self._inside, "worker", False):
            results: list[R] = []
            for item in items:
                results.append(task(item))
                if stop(results[-1]):
                    break
            return results
        executor = self._pool()
        tenant = current_tenant()

        def run(item: T) -> R:
            with call_tenant(tenant):
                return task(item)

        pending: deque[Future[R]] = deque()
        results = []
        upcoming = iter(items)
        try:
            for item in upcoming:
                pending.append(executor.submit(run, item))
                if len(pending) == width:
                    break
            stopped = False
            while pending:
                results.append(pending.popleft().result())
                stopped = stopped or stop(results[-1])
                if not stopped:
                    for item in upcoming:
                        pending.append(executor.submit(run, item))
                        break
            return results
        finally:
            # Only after an exception is anything still pending here: wait for it anyway.
            wait(pending)

    @contextmanager
    def ahead(self, task: Callable[[int], R], count: int) -> Iterator[Callable[[int], R]]:
        """``task(i)`` for ``i`` in ``range(count)``, run up to ``workers`` ahead of the
        caller: yields ``result``, which answers ``task(i)`` once it has finished, and is
        asked for ``i`` in increasing order (skipping some is fine). When the caller asks
        for ``i``, tasks up to ``i + workers`` may be running: ``workers + 1`` buffers
        used round robin (``i % (workers + 1)``) are never written while in use. Tasks
        still running when the block ends are waited for."""
        if self.workers == 1 or count < 2 or getattr(self._inside, "worker", False):
            yield task
            return
        executor = self._pool()
        tenant = current_tenant()

        def run(index: int) -> R:
            with call_tenant(tenant):
                return task(index)

        started: dict[int, Future[R]] = {}
        submitted = 0

        def result(index: int) -> R:
            nonlocal submitted
            for stale in [j for j in started if j < index]:
                started.pop(stale).result()  # skipped: its buffer is reused from here
            while submitted < min(count, index + self.workers + 1):
                started[submitted] = executor.submit(run, submitted)
                submitted += 1
            return started.pop(index).result()

        try:
            yield result
        finally:
            wait(list(started.values()))

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._owner != os.getpid():
                # A forked child inherits the executor but not its threads: start afresh.
                self._executor, self._owner = None, os.getpid()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.workers, thread_name_prefix="hicache-seal",
                    initializer=self._mark_worker,
                )
            return self._executor

    def _mark_worker(self) -> None:
        self._inside.worker = True


_shared: SealWorkers | None = None
_shared_lock = threading.Lock()


def shared_seal_workers() -> SealWorkers:
    """The process's one default pool (every sealer without its own shares it: the cores
    are the process's, not a backend's)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SealWorkers()
        return _shared
