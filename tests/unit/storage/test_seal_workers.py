"""SealWorkers: a batch's per-page tasks on a few threads, in order, for the caller's tenant."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hicache.storage.call_tenant import call_tenant, current_tenant
from hicache.storage.seal_workers import MAX_SEAL_WORKERS, SealWorkers, usable_cores
from tests.waiting import wait_until


@pytest.fixture
def workers() -> SealWorkers:
    pool = SealWorkers(2)
    yield pool
    pool.close()


def test_the_pool_is_bounded_by_the_cores_and_the_cap() -> None:
    assert SealWorkers(1000).workers == MAX_SEAL_WORKERS
    assert SealWorkers(0).workers == 1
    assert SealWorkers().workers == min(usable_cores(), MAX_SEAL_WORKERS)


@pytest.mark.parametrize("count", [1, 2])
def test_ordered_matches_the_serial_path_and_carries_the_tenant(count: int) -> None:
    pool = SealWorkers(count)
    threads: set[int] = set()

    def task(item: int) -> tuple[int, str | None]:
        threads.add(threading.get_ident())
        return item * item, current_tenant()

    with call_tenant("acme"):
        results = pool.ordered(task, list(range(20)), stop=lambda result: False)
    assert results == [(i * i, "acme") for i in range(20)]
    assert current_tenant() is None
    if count == 1:
        assert threads == {threading.get_ident()}  # inline: no thread made
    else:
        assert threading.get_ident() not in threads
    pool.close()


def test_ordered_starts_nothing_past_the_window_after_a_stop(workers: SealWorkers) -> None:
    started: list[int] = []
    lock = threading.Lock()

    def task(item: int) -> int:
        with lock:
            started.append(item)
        return item

    results = workers.ordered(task, list(range(50)), stop=lambda result: result == 3)
    # Results are a prefix: up to the stopping one and what ran beside it (the window).
    assert results[:4] == [0, 1, 2, 3]
    assert results == list(range(len(results))) and len(results) <= 4 + workers.workers
    assert sorted(started) == results  # every started task was waited for and answered


def test_ordered_waits_for_running_tasks_when_one_raises(workers: SealWorkers) -> None:
    finished: list[int] = []
    release = threading.Event()

    def task(item: int) -> int:
        if item == 0:
            raise ValueError("boom")
        release.wait(5)
        finished.append(item)
        return item

    threading.Timer(0.05, release.set).start()
    with pytest.raises(ValueError, match="boom"):
        workers.ordered(task, [0, 1, 2], stop=lambda result: False)
    assert finished == [1]  # item 1 was running and was waited for; 2 never started


def test_a_task_that_calls_the_pool_runs_inline(workers: SealWorkers) -> None:
    def inner(item: int) -> int:
        return item + 1

    def outer(item: int) -> list[int]:
        return workers.ordered(inner, [item, item], stop=lambda result: False)

    assert workers.ordered(outer, [1, 2, 3], stop=lambda result: False) == [
        [2, 2], [3, 3], [4, 4]
    ]


def test_beside_a_copy_one_core_is_left_to_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.storage import seal_workers

    for cores, workers, beside in ((1, 1, 1), (2, 2, 1), (2, 1, 1), (3, 2, 2), (16, 4, 4)):
        monkeypatch.setattr(seal_workers, "usable_cores", lambda cores=cores: cores)
        assert SealWorkers(workers).beside_copy() == beside, (cores, workers)


def test_ordered_runs_at_most_the_threads_asked_for() -> None:
    pool = SealWorkers(3)
    lock = threading.Lock()
    running = peak = 0
    threads: set[int] = set()

    def task(item: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            threads.add(threading.get_ident())
        # Overlap with the tasks submitted beside this one, if any were.
        barrier_wait = threading.Event()
        barrier_wait.wait(0.002)
        with lock:
            running -= 1
        return item

    assert pool.ordered(task, list(range(30)), stop=lambda r: False, threads=2) == list(
        range(30)
    )
    assert peak <= 2 and threading.get_ident() not in threads
    threads.clear()
    assert pool.ordered(task, list(range(5)), stop=lambda r: False, threads=1) == list(range(5))
    assert threads == {threading.get_ident()}  # one thread: inline on the caller's
    pool.close()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_ahead_never_writes_a_slot_the_caller_still_reads(count: int) -> None:
    """Task i writes slot i % (workers + 1), which the caller holds from the answer for
    i until it asks for a later one: no task may start on a held slot."""
    submitted: list[int] = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            submitted.append(args[0])
            return super().submit(fn, *args, **kwargs)

    pool = SealWorkers(count)
    pool._executor = Recording(pool.workers)  # what _pool() would make, recording
    slots = pool.workers + 1
    held: set[int] = set()
    clashes: list[int] = []
    lock = threading.Lock()

    def task(index: int) -> int:
        with lock:
            if index % slots in held:
                clashes.append(index)
        return index

    with call_tenant("acme"), pool.ahead(task, 40) as result:
        for index in range(40):
            if index % 7 == 3:
                continue  # skipped, as a page already stored is
            with lock:
                held.clear()  # asking for a page is being done with the ones before
            got = result(index)
            with lock:
                held.add(index % slots)
            assert got == index
            # Deterministically: nothing past the window was even handed to a thread.
            assert max(submitted, default=index) <= index + pool.workers
    assert clashes == []
    pool.close()


def test_ahead_waits_for_what_it_started_when_the_caller_stops_early(
    workers: SealWorkers,
) -> None:
    leave = threading.Event()
    started: set[int] = set()
    finished: set[int] = set()
    lock = threading.Lock()

    def task(index: int) -> int:
        with lock:
            started.add(index)
        if index > 0:
            leave.wait(5)
        with lock:
            finished.add(index)
        return index

    with workers.ahead(task, 10) as result:
        assert result(0) == 0
        assert wait_until(lambda: len(started) == 1 + workers.workers)
        leave.set()
    # Leaving the block waited for every task started beside page 0, and started no more.
    assert finished == started == set(range(1 + workers.workers))


def test_a_forked_child_starts_its_own_threads(workers: SealWorkers) -> None:
    """A child process inherits the executor without its threads: the pool notices the
    process changed and makes a new one rather than queueing work no thread runs."""
    assert workers.ordered(lambda item: item, [1, 2], stop=lambda result: False) == [1, 2]
    inherited = workers._executor
    workers._owner = -1  # as seen from a forked child
    assert workers.ordered(lambda item: item, [3, 4], stop=lambda result: False) == [3, 4]
    assert workers._executor is not inherited
    assert inherited is not None
    inherited.shutdown()
