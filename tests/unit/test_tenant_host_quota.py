"""Host quotas per tenant on a real cache (L1 + L2): a tenant past its share of the host
pool evicts its own least recently used host-only pages, never another tenant's; when its
own pages cannot make room its new pages are not backed up, and every request still gets
the cold KV; a prefetch from L3 is cut at the quota; under write_back a device eviction
may pass it; the quota survives a flush; bad shares are a ConfigError."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, ConfigError
from hicache.memory.geometry import KVGeometry
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.kv_oracle import conversation, expected_kv, settle
from tests.storage_reference import MemoryBackend, MemoryStore
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 2
DEVICE_PAGES = 16
HOST_PAGES = 40
QUOTA = 0.25  # tenant "a": 10 host pages


def serve(cache: HierarchicalCache, tokens: list[int], tenant: str | None) -> int:
    """One request of ``tenant``: reuse what is cached (checked against the cold KV), compute
    the rest, hand it to the tree; returns the cached tokens."""
    ps = cache.page_size
    hit = cache.acquire(tokens, tenant)
    for layer in range(GEOMETRY.num_layers):
        cache.wait_layer(layer)  # the host part is loaded asynchronously
    full = len(tokens) // ps * ps
    want = expected_kv(tokens[:full], GEOMETRY, ps)
    cached = len(hit.device_pages)
    if cached:
        got = cache.device_pool.pages[torch.from_numpy(hit.device_pages)]
        assert torch.equal(got, want[:cached]), "cached KV differs from cold KV"
    fresh = cache.alloc_device(full // ps - cached)
    cache.device_pool.pages[torch.from_numpy(fresh)] = want[cached:]
    cache.insert(tokens[:full], np.concatenate([hit.device_pages, fresh]), tenant)
    cache.release(hit)
    cache.poll(wait=True)
    cache.check_integrity()
    return hit.num_tokens


def empty_device(cache: HierarchicalCache) -> None:
    """Push every unheld page out of L1: backed-up pages stay on the host only."""
    allocator = cache.device_pool.allocator
    cache.free_device(
        cache.alloc_device(allocator.num_free_pages + cache.tree.num_evictable_device_pages)
    )


@pytest.fixture
def cache() -> Iterator[HierarchicalCache]:
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1, tenant_host_fractions={"a": QUOTA},
    )
    built = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        yield built
    finally:
        built.close()


def test_quota_is_a_share_of_the_host_pool(cache: HierarchicalCache) -> None:
    assert cache.tree.host_quota("a") == 10
    assert cache.tree.host_quota("b") is None


def test_over_quota_tenant_evicts_its_own_lru_pages_only(cache: HierarchicalCache) -> None:
    b_prompt = conversation(12, seed=99)  # 6 pages of b, backed up first (the oldest)
    serve(cache, b_prompt, "b")
    empty_device(cache)
    b_host = cache.tree.tenant_host_pages("b")
    assert b_host == 6
    prompts = [conversation(8, seed=s) for s in range(5)]  # 4 pages each: 20 in all
    for prompt in prompts:
        serve(cache, prompt, "a")
        empty_device(cache)  # host-only now: what a quota may evict
        assert cache.tree.tenant_host_pages("a") <= 10
    assert cache.tree.tenant_host_pages("a") == 8  # whole prompts of 4: the last two
    assert cache.stats.num_host_quota_evicted_pages == 12
    assert cache.tree.tenant_host_pages("b") == b_host  # b's older pages untouched
    # b's prompt and a's newest still hit from the host, a's oldest are gone, and every
    # hit is the cold KV (serve checks it).
    assert serve(cache, b_prompt, "b") == 12
    assert serve(cache, prompts[-1], "a") == 8
    assert serve(cache, prompts[0], "a") == 0


def test_without_room_of_its_own_new_pages_are_not_kept(cache: HierarchicalCache) -> None:
    first = conversation(20, seed=1)  # 10 pages: the whole quota
    serve(cache, first, "a")
    assert cache.tree.tenant_host_pages("a") == 10
    held = cache.acquire(first, "a")  # a request holds them: not evictable
    skipped = cache.stats.num_backup_skipped_pages
    serve(cache, conversation(8, seed=2), "a")  # answered, but not backed up
    assert cache.tree.tenant_host_pages("a") == 10
    assert cache.stats.num_backup_skipped_pages > skipped
    serve(cache, conversation(8, seed=3), "b")  # another tenant is not limited by a's quota
    assert cache.tree.tenant_host_pages("b") == 4
    cache.release(held)
    cache.check_integrity()


def test_quota_survives_a_flush(cache: HierarchicalCache) -> None:
    serve(cache, conversation(8, seed=1), "a")
    cache.flush()
    assert cache.tree.host_quota("a") == 10
    assert cache.tree.tenant_host_pages("a") == 0


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_bad_share_is_a_config_error(share: float) -> None:
    with pytest.raises(ConfigError, match="tenant 'a'"):
        CacheConfig(tenant_host_fractions={"a": share})


def test_write_back_eviction_frees_the_device_past_the_quota() -> None:
    """Under write_back a backup is the only way to free a device page: a tenant at its
    quota must not make the device pool unusable for others."""
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1, write_policy="write_back",
        tenant_host_fractions={"a": 0.1},  # 4 host pages
        host_core_fraction=0.0,  # which of a's pages the quota keeps is LRU's choice
    )
    cache = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        for seed in range(3):  # 12 device pages of a, none backed up yet
            serve(cache, conversation(8, seed=seed), "a")
        assert cache.tree.tenant_device_pages("a") == 12
        # b needs 10 device pages: a's are written back (past a's quota) to make room.
        assert serve(cache, conversation(20, seed=9), "b") == 0
        assert cache.tree.tenant_device_pages("b") == 10
        assert serve(cache, conversation(8, seed=0), "a") == 8  # a's KV kept, the cold KV
    finally:
        cache.close()


def test_a_prefetch_from_l3_stays_within_the_quota() -> None:
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1, tenant_host_fractions={"a": QUOTA},  # 10 host pages
    )
    cache = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        cache.attach_storage(
            StorageConfig(backend="memory", prefetch_threshold=1,
                          prefetch_policy=PrefetchPolicy.WAIT_COMPLETE),
            MemoryBackend(MemoryStore()),
        )
        long_prompt = conversation(28, seed=5)  # 14 pages: more than a's quota
        serve(cache, long_prompt[:20], "a")  # 10 pages of it go to L3 through the host
        settle(cache)
        cache.flush()
        serve(cache, long_prompt[20:], "a")  # an unrelated 4 pages of a's on the host
        settle(cache)
        handle = cache.prefetch(long_prompt, "a")
        assert handle is not None

        def ready() -> bool:
            cache.poll()
            return cache.prefetch_ready(handle)

        assert wait_until(ready, 60.0, poll_s=0.001)
        landed = cache.finish_prefetch(handle)
        assert 0 < landed < 20  # the quota cut it short...
        assert cache.tree.tenant_host_pages("a") <= 10  # ...and a stays within it
        # What landed is the cold KV (serve checks), the rest is computed.
        assert serve(cache, long_prompt, "a") == landed
        settle(cache)
    finally:
        cache.close()
