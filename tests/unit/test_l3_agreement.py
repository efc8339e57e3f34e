"""The L3 tier under tensor parallelism, one rank alone (it agrees with itself; the
group runs are in ``tests/e2e/engine/test_replication_l3.py``): prefetches take the
agreement slots in order and wait for a free one, a prefetch settles with the agreed
number of landed pages, the pages it did not keep stay held until every rank's I/O for
it returned (a stalled read's included), and backups are acknowledged only when agreed,
a flush or a detach during a stalled backup included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.cache.l3 import PrefetchHandle
from hicache.cache.l3_agreement import NUM_SLOTS
from tests.kv_oracle import conversation, serve, serve_with_l3, settle
from tests.storage_reference import MemoryStore
from tests.unit.test_l3_cache import make_cache
from tests.waiting import wait_until

# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0
# The call deadline: the stalled call (hung until the test releases it) waits it out, and
# no other call may come near it on a busy machine (one stalled call is expected).
IO_TIMEOUT_S = 2.0


def _replicated(store: MemoryStore) -> HierarchicalCache:
    cache, _ = make_cache(store)
    cache.replicated = True
    return cache


def _tick(cache: HierarchicalCache) -> None:
    """One tick's agreement of a rank alone: its own progress is the agreed one."""
    l2 = cache.observe_progress()
    l3 = cache.observe_l3_progress()
    cache.apply_progress(l2)
    cache.apply_l3_progress(l3)


def _tick_until(cache: HierarchicalCache, what: str, done: Callable[[], bool]) -> None:
    def ticked_until_done() -> bool:
        if done():
            return True
        _tick(cache)
        return False

    assert wait_until(ticked_until_done, WAIT_S, poll_s=0.001), f"timed out waiting for {what}"


def test_prefetches_past_the_slots_wait_for_one() -> None:
    cache = _replicated(MemoryStore())
    try:
        handles = [cache.prefetch(conversation(16, seed=i)) for i in range(NUM_SLOTS)]
        assert all(h is not None for h in handles)
        assert not cache.prefetch_slot_free
        assert cache.prefetch(conversation(16, seed=NUM_SLOTS)) is None
        first = handles[0]
        assert first is not None
        cache.cancel_prefetch(first)  # settled, but its slot drains first
        _tick_until(cache, "a free slot", lambda: cache.prefetch_slot_free)
        assert cache.prefetch(conversation(16, seed=NUM_SLOTS)) is not None
        for handle in handles[1:]:
            assert handle is not None
            cache.cancel_prefetch(handle)
        settle(cache)
    finally:
        cache.close()


def test_a_prefetch_settles_with_the_agreed_landed_pages_only() -> None:
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store)
    cache = _replicated(store)
    try:
        assert serve_with_l3(first, tokens) == 0
        settle(first)
        handle = cache.prefetch(tokens)
        assert isinstance(handle, PrefetchHandle)
        _tick_until(cache, "the read", lambda: cache.prefetch_done(handle))
        assert handle.agreed is not None and handle.agreed.num_found_pages == 10
        assert handle.op.num_landed == 10
        # Another rank landed only 4 pages: that is what every rank keeps.
        handle.agreed = dataclasses.replace(handle.agreed, num_landed_pages=4)
        host = cache.host_pool
        assert host is not None
        free_before = host.allocator.num_free_pages
        assert cache.finish_prefetch(handle) == 16
        # The 6 pages not kept are freed by the next agreement, not at once.
        assert host.allocator.num_free_pages == free_before
        _tick(cache)
        assert host.allocator.num_free_pages == free_before + 6
        assert serve(cache, tokens) == 16  # and the 16 tokens are cold KV bit for bit
        settle(cache)
    finally:
        first.close()
        cache.close()


def test_backups_are_acknowledged_when_agreed() -> None:
    store = MemoryStore()
    cache = _replicated(store)
    try:
        serve(cache, conversation(40))
        cache.poll(wait=True)  # the device->host copies landed: backups queued
        storage = cache.storage
        assert storage is not None
        assert storage.controller.wait_idle(WAIT_S)
        storage.poll()
        assert len(store.pages) == 10  # written...
        assert cache.stats.num_storage_backed_up_pages == 0  # ...but not acknowledged
        assert cache.observe_l3_progress().num_done_backups > 0
        _tick(cache)
        assert cache.stats.num_storage_backed_up_pages == 10
        assert cache.observe_l3_progress().num_done_backups == 0
        settle(cache)
    finally:
        cache.close()


def test_a_stalled_read_keeps_its_slot_and_pages_until_it_returns() -> None:
    """The read stalls past the call deadline on this rank: the prefetch settles with
    nothing, but its slot drains (and its host pages stay reserved) until the call
    returned here; then the next agreement frees them all at once."""
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store)
    cache, backend = make_cache(store, io_timeout_s=IO_TIMEOUT_S)
    cache.replicated = True
    try:
        assert serve_with_l3(first, tokens) == 0
        settle(first)
        gate = backend.stall("get")
        host, storage = cache.host_pool, cache.storage
        assert host is not None and storage is not None
        free_before = host.allocator.num_free_pages
        handle = cache.prefetch(tokens)
        assert isinstance(handle, PrefetchHandle)
        _tick_until(cache, "the stalled read", lambda: cache.prefetch_done(handle))
        assert storage.num_quarantined_pages == 10
        assert cache.finish_prefetch(handle) == 0
        for _ in range(20):  # however long it takes, the stalled call holds the slot
            cache.poll()
            _tick(cache)
        assert storage.agreement.num_slots_in_use == 1
        assert host.allocator.num_free_pages == free_before - 10
        gate.set()
        _tick_until(cache, "the drained slot", lambda: (
            cache.poll() or not storage.agreement.num_slots_in_use
        ))
        assert storage.num_quarantined_pages == 0
        assert host.allocator.num_free_pages == free_before
        settle(cache)
    finally:
        first.close()
        cache.close()


def _stalled_backup(store: MemoryStore) -> tuple[HierarchicalCache, Callable[[], None]]:
    """A rank alone whose first backup's ``set`` stalls past the call deadline (the
    caller releases it with the returned function) once a conversation is served."""
    cache, backend = make_cache(store, io_timeout_s=IO_TIMEOUT_S)
    cache.replicated = True
    gate = backend.stall("set")
    serve(cache, conversation(40))
    cache.poll(wait=True)  # the device->host copies landed: backups queued
    storage = cache.storage
    assert storage is not None
    assert storage.controller.wait_idle(WAIT_S)  # finished: the set stalled at its deadline
    storage.poll()
    assert storage.controller.num_stalled_calls == 1
    return cache, gate.set


@pytest.mark.parametrize("op", ["flush", "detach"])
def test_a_flush_or_detach_keeps_a_stalled_backup_until_it_is_agreed(op: str) -> None:
    """Every backup not agreed finished keeps its host pages (flush: outside the tree)
    or its protected node (detach) until the ranks agree it finished, however long the
    stalled call takes; then the next agreement releases it, on every rank alike."""
    cache, release = _stalled_backup(MemoryStore())
    try:
        host, storage = cache.host_pool, cache.storage
        assert host is not None and storage is not None
        if op == "flush":
            cache.flush()
        else:
            cache.detach_storage()
        for _ in range(20):
            _tick(cache)
        assert cache.l3_awaits_agreement
        if op == "flush":
            assert storage.num_quarantined_pages == 10
            assert host.allocator.num_free_pages == host.allocator.num_pages - 10
        else:
            assert cache.storage is None
            assert cache.tree.num_host_pages == 10
            assert any(node.host_ref > 0 for node in cache.tree.iter_nodes())
        cache.check_integrity()
        release()
        _tick_until(cache, "the agreed backup", lambda: (
            cache.poll() or not cache.l3_awaits_agreement
        ))
        assert storage.num_quarantined_pages == 0
        assert all(node.host_ref == 0 for node in cache.tree.iter_nodes())
        if op == "flush":
            assert host.allocator.num_free_pages == host.allocator.num_pages
        cache.check_integrity()
    finally:
        cache.close()
