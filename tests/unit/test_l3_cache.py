"""The L3 tier driven by the cache: backup L2 -> L3, prefetch L3 -> L2 -> L1, policies, faults.

Every request goes through the KV oracle (``tests.kv_oracle.serve``): KV that
came back from L3 must equal cold KV bit for bit, and every pool must pass its
integrity check (no page lost or owned twice) after every step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.cache.l3 import PrefetchHandle
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.storage import controller as storage_controller
from hicache.storage.base import StorageError, StorageUnavailableError
from hicache.storage.breaker import BreakerState
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.kv_oracle import conversation, serve, serve_with_l3, settle
from tests.storage_reference import MemoryBackend, MemoryStore
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
MLA_GEOMETRY = KVGeometry.mla(num_layers=2, latent_dim=6, dtype=torch.float32)
# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0
# A prefetch deadline that a read of 128 in-memory pages meets on a busy machine.
TIMED_DEADLINE_S = 1.5


def make_cache(
    store: MemoryStore,
    *,
    page_size: int = 4,
    layout: MemLayout = MemLayout.PAGE_FIRST,
    device_pages: int = 64,
    policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    geometry: KVGeometry = GEOMETRY,
    **storage: object,
) -> tuple[HierarchicalCache, MemoryBackend]:
    config = CacheConfig(
        page_size=page_size, enable_hierarchical_cache=True, write_policy=policy,
        io_backend=IOBackendKind.DIRECT, mem_layout=layout, load_back_threshold_tokens=1,
    )
    cache = HierarchicalCache(config, geometry, device_pages)
    backend = MemoryBackend(store)
    defaults: dict[str, object] = {
        "prefetch_threshold": 1, "prefetch_policy": PrefetchPolicy.WAIT_COMPLETE,
    }
    cache.attach_storage(StorageConfig(backend="memory", **{**defaults, **storage}), backend)  # type: ignore[arg-type]
    return cache, backend


def read_started(cache: HierarchicalCache, handle: PrefetchHandle) -> Callable[[], bool]:
    """A wait_until condition: the prefetch's read has started; it polls L3 until then."""

    def started() -> bool:
        if handle.op.host_pages is not None:
            return True
        cache.poll()
        return False

    return started


@pytest.mark.parametrize("geometry", [GEOMETRY, MLA_GEOMETRY], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_second_instance_hits_what_the_first_backed_up(
    layout: MemLayout, page_size: int, geometry: KVGeometry
) -> None:
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store, page_size=page_size, layout=layout, geometry=geometry)
    second, _ = make_cache(store, page_size=page_size, layout=layout, geometry=geometry)
    try:
        assert serve_with_l3(first, tokens) == 0
        settle(first)
        assert first.stats.num_storage_backed_up_pages == 40 // page_size
        assert len(store.pages) == 40 // page_size
        # The second instance has nothing locally: all 40 tokens come from L3,
        # and serve() checks they equal cold KV.
        assert serve_with_l3(second, tokens) == 40
        assert second.stats.num_storage_hit_tokens == 40
        settle(second)
        # Its own backup found every page already in L3 and wrote none.
        assert second.stats.num_storage_backed_up_pages == 0
    finally:
        first.close()
        second.close()


def test_prefetch_continues_a_local_prefix_and_stops_at_a_missing_page() -> None:
    store = MemoryStore()
    tokens = conversation(48)
    first, _ = make_cache(store)
    second, backend = make_cache(store)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        serve_with_l3(second, tokens[:16])  # 4 pages, now local
        settle(second)
        # Page 8 of the chain vanished from L3: only pages 4..7 can come back.
        keys = first.tree.page_keys(first.tree.match_prefix(tokens).last_node)
        backend.drop(keys[8])
        before = second.stats.num_storage_hit_tokens
        assert serve_with_l3(second, tokens) == 32  # a continuous prefix only
        assert second.stats.num_storage_hit_tokens - before == 16
        settle(second)
    finally:
        first.close()
        second.close()


def test_a_page_failing_verification_at_read_time_ends_the_prefix() -> None:
    store = MemoryStore()
    tokens = conversation(48)
    first, _ = make_cache(store)
    second, backend = make_cache(store)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        keys = first.tree.page_keys(first.tree.match_prefix(tokens).last_node)
        # L3 says all 12 pages exist, but page 5 is corrupt when read: pages 0..4
        # are used, the rest recomputed, and serve() checks the KV is cold KV.
        backend.corrupt_keys.add(keys[5])
        assert serve_with_l3(second, tokens) == 20
        settle(second)
    finally:
        first.close()
        second.close()


def test_below_the_threshold_no_prefetch_starts() -> None:
    store = MemoryStore()
    cache, backend = make_cache(store, prefetch_threshold=64)
    try:
        assert cache.prefetch(conversation(60)) is None
        assert "exists" not in backend.calls
    finally:
        cache.close()


def test_best_effort_never_waits_and_timeout_takes_what_arrived(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore()
    tokens = conversation(300)
    first, _ = make_cache(store, page_size=1, device_pages=400)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()

    eager, _ = make_cache(
        store, page_size=1, device_pages=400, prefetch_policy=PrefetchPolicy.BEST_EFFORT
    )
    try:
        handle = eager.prefetch(tokens)
        assert handle is not None and eager.prefetch_ready(handle)
        eager.finish_prefetch(handle)  # before the lookup answered: nothing to use
        assert serve(eager, tokens) == 0
        settle(eager)
    finally:
        eager.close()

    # 300 pages = reads of 128 + 128 + 44 pages: the first lands at once, the second hangs
    # until the test releases it, so the deadline lets exactly one land however slow the
    # machine. The call deadline is far away: a request that waited for the hung read
    # would wait for it, past the bound below.
    timed, backend = make_cache(
        store, page_size=1, device_pages=400, prefetch_policy=PrefetchPolicy.TIMEOUT,
        prefetch_timeout_base=TIMED_DEADLINE_S, prefetch_timeout_per_ki_token=0.0,
        io_timeout_s=WAIT_S,
    )
    read = backend.get
    gate = threading.Event()

    def first_read_then_hang(keys: Sequence[bytes], host_pages: PageIds) -> int:
        try:
            return read(keys, host_pages)
        finally:
            backend.gates.setdefault("get", gate)  # the reads after this one hang

    monkeypatch.setattr(backend, "get", first_read_then_hang)
    try:
        began = time.monotonic()
        assert serve_with_l3(timed, tokens) == 128
        waited = time.monotonic() - began
        assert TIMED_DEADLINE_S <= waited < TIMED_DEADLINE_S + 10.0, waited
    finally:
        gate.set()
    try:
        settle(timed)  # the abandoned read returns and its pages are freed
    finally:
        timed.close()


def test_an_auto_prefetch_deadline_follows_the_observed_read_time() -> None:
    store = MemoryStore()
    chats = [conversation(32, seed) for seed in range(4)]  # 8 pages of 4 tokens each
    first, _ = make_cache(store)
    for tokens in chats:
        serve_with_l3(first, tokens)
    settle(first)
    first.close()

    def check_allowance_after_reads(delay_per_page_s: float) -> None:
        """The seconds per 1024 tokens an auto deadline grants once 3 reads were timed."""
        cache, backend = make_cache(
            store, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_base=1.0,
            prefetch_timeout_per_ki_token="auto", prefetch_timeout_max=300.0,
        )
        backend.delay_per_page = delay_per_page_s
        try:
            storage = cache.storage
            assert storage is not None
            assert storage.prefetch_timeout_per_ki_token_s == 0.1  # nothing observed yet
            longest = 0.0  # the longest request: each read took at most that long
            for tokens in chats[:3]:
                began = time.monotonic()
                assert serve_with_l3(cache, tokens) == 32
                longest = max(longest, time.monotonic() - began)
            allowance = storage.prefetch_timeout_per_ki_token_s
            # 256 pages of 4 tokens per 1024 tokens, three times the time observed per page
            # (an average of the reads'): each read of 8 pages took at least its delay, and
            # at most its whole request (what else a busy machine adds is not bounded here).
            assert 3 * delay_per_page_s * 256 <= allowance <= 3 * longest / 8 * 256, (
                allowance, longest,
            )
            # The next request's deadline is base + that allowance for its 32 tokens,
            # counted from when it was asked for.
            expected = 1.0 + allowance * 32 / 1024
            began = time.monotonic()
            handle = cache.prefetch(chats[3])
            ended = time.monotonic()
            assert handle is not None and handle.deadline is not None
            assert began + expected - 1e-6 <= handle.deadline <= ended + expected + 1e-6
            cache.cancel_prefetch(handle)
            settle(cache)
        finally:
            cache.close()

    check_allowance_after_reads(0.04)
    check_allowance_after_reads(0.01)


def test_cancel_and_detach_release_everything_in_flight() -> None:
    store = MemoryStore()
    tokens = conversation(300)
    first, _ = make_cache(store, page_size=1, device_pages=400)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()

    cache, backend = make_cache(store, page_size=1, device_pages=400)
    backend.delay_per_batch = 0.2
    try:
        handle = cache.prefetch(tokens)
        assert handle is not None
        assert wait_until(read_started(cache, handle), poll_s=0.005), "the read never started"
        cache.cancel_prefetch(handle)
        assert handle.finished and handle.num_inserted_tokens == 0
        settle(cache)
        assert cache.tree.num_host_pages == 0  # nothing of the cancelled prefetch kept

        # Detach with a read in flight: it drains, settles, and is idempotent.
        handle = cache.prefetch(tokens)
        assert handle is not None
        assert wait_until(read_started(cache, handle), poll_s=0.005), "the read never started"
        cache.detach_storage()
        cache.detach_storage()
        assert cache.storage is None and backend.closed == 1
        assert cache.prefetch_ready(handle)
        cache.finish_prefetch(handle)  # harmless after detach
        cache.check_integrity()
    finally:
        cache.close()


def test_a_dead_store_is_a_miss_then_the_breaker_opens_and_recovers() -> None:
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()

    cache, backend = make_cache(store, breaker_failures=2, breaker_backoff_base=0.2)
    assert cache.storage is not None
    # The breaker's backoff runs on a clock the test moves: it ends when the test says.
    now = [0.0]
    cache.storage.breaker._clock = lambda: now[0]
    try:
        backend.down = True
        for i in range(4):  # every request still succeeds, recomputing
            assert serve_with_l3(cache, conversation(40, seed=i + 1)) == 0
        settle(cache)
        assert cache.storage is not None
        assert cache.storage.breaker.state is BreakerState.OPEN
        calls = len(backend.calls)
        serve_with_l3(cache, conversation(40, seed=9))
        settle(cache)
        assert len(backend.calls) == calls  # refused without calling the store
        assert cache.storage.metrics().failures.get("breaker_open", 0) > 0

        backend.down = False
        now[0] += 0.25  # past the backoff: the next call is the trial
        assert serve_with_l3(cache, tokens) == 40
        assert cache.storage.breaker.state is BreakerState.CLOSED
        settle(cache)
    finally:
        cache.close()


def test_a_raising_backend_is_a_miss_not_a_failed_request() -> None:
    store = MemoryStore()
    cache, backend = make_cache(store)
    backend.raise_errors = True
    try:
        assert serve_with_l3(cache, conversation(40)) == 0
        settle(cache)
        assert cache.storage is not None
        failures = cache.storage.metrics().failures
        assert failures.get("exists_raised", 0) >= 1
    finally:
        cache.close()


def test_prefetched_host_pages_respect_the_in_flight_budget() -> None:
    store = MemoryStore()
    tokens = conversation(64)
    first, _ = make_cache(store, page_size=1, device_pages=100)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()
    # Host pool = 200 pages; at most 10% (20 pages) may be held by prefetches.
    cache, _ = make_cache(store, page_size=1, device_pages=100, prefetch_max_host_fraction=0.1)
    try:
        assert serve_with_l3(cache, tokens) == 20
        settle(cache)
    finally:
        cache.close()


def test_attach_rules() -> None:
    store = MemoryStore()
    cache, backend = make_cache(store)
    try:
        assert cache.storage is not None
        same = StorageConfig(backend="memory", prefetch_policy=PrefetchPolicy.TIMEOUT)
        cache.attach_storage(same)  # the attached backend again: only policies change
        assert cache.storage.config.prefetch_policy is PrefetchPolicy.TIMEOUT
        assert cache.storage.backend is backend
        with pytest.raises(StorageError, match="detach it first"):
            cache.attach_storage(StorageConfig(backend="other"))
        cache.detach_storage()
        down = MemoryBackend(store)
        down.unreachable_at_attach = True
        with pytest.raises(StorageUnavailableError):
            cache.attach_storage(StorageConfig(backend="memory"), down)
        assert cache.storage is None
        cache.check_integrity()
    finally:
        cache.close()
    plain = HierarchicalCache(CacheConfig(), GEOMETRY, 8)
    with pytest.raises(StorageError, match="--enable-hierarchical-cache"):
        plain.attach_storage(StorageConfig(backend="memory"), MemoryBackend(store))


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK])
def test_a_device_only_prefix_is_backed_up_before_its_continuation_is_fetched(
    policy: WritePolicy,
) -> None:
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()
    second, _ = make_cache(store, policy=policy)
    try:
        serve_with_l3(second, tokens[:12])  # device-only under these policies
        settle(second)
        assert serve_with_l3(second, tokens) == 40
        settle(second)
    finally:
        second.close()


def test_a_backup_is_one_set_per_batch_and_no_exists() -> None:
    store = MemoryStore()
    cache, backend = make_cache(store, page_size=1, device_pages=400)
    try:
        serve_with_l3(cache, conversation(300))  # its lookup is one exists (L3 is empty)
        settle(cache)
        # 300 pages: sets of 128 + 128 + 44; set itself skips what L3 already has.
        assert backend.calls == ["exists", "set", "set", "set"]
        assert len(store.pages) == 300
        assert cache.storage is not None
        assert cache.storage.metrics().backup_pages_stored == 300
    finally:
        cache.close()


def test_stalled_calls_are_capped_and_outlive_a_detach(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    tokens = conversation(40)
    first, _ = make_cache(store)
    serve_with_l3(first, tokens)
    settle(first)
    first.close()
    # Each stalled get costs a call deadline, long enough that no other call (a lookup,
    # a backup) reaches it on a busy machine; a lower cap keeps the stalls few.
    cap = 2
    monkeypatch.setattr(storage_controller, "MAX_STALLED_CALLS", cap)
    # No backoff: every prefetch tries the store again, and every get hangs.
    cache, backend = make_cache(
        store, device_pages=400, io_timeout_s=2.0, breaker_backoff_base=0.0,
        breaker_backoff_max=0.0,
    )
    gate = backend.stall("get")
    try:
        for _ in range(cap + 3):
            assert serve_with_l3(cache, tokens) == 0
            settle(cache)
            cache.flush()  # so that the next request asks L3 again
        assert cache.storage is not None
        metrics = cache.storage.metrics()
        assert len(backend.stalled_pages("get")) == cap
        assert metrics.stalled_calls == cap
        # Only the gets stalled: no other call came near the deadline.
        assert metrics.failures.get("timeout") == cap
        assert metrics.failures.get("stalled_limit", 0) >= 1
        assert cache.storage.num_quarantined_pages == cap * 10

        # Detach with the calls still hung: their pages stay reserved, the backend open.
        cache.detach_storage()
        assert cache.storage is None and backend.closed == 0
        cache.check_integrity()
        host = cache.host_pool
        assert host is not None and host.allocator.num_used_pages == cap * 10
    finally:
        gate.set()

    def closed() -> bool:  # once every call returned, the backend is closed
        if backend.closed:
            return True
        cache.poll()
        return False

    assert wait_until(closed, WAIT_S), "the backend was never closed"
    assert host.allocator.num_used_pages == 0
    cache.check_integrity()
    cache.close()
