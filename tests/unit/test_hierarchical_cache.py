"""HierarchicalCache end to end on real pools: KV served from L1 or L2 equals cold KV.

"Computing" a token writes KV that is a deterministic function of its whole
prefix. Every request checks that the pages the cache hands back (device hits
and pages loaded back from the host) hold exactly that KV, under memory
pressure, for every host layout, page size and write policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache.memory.host_memory as host_memory
from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, ConfigError, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.allocator import OutOfPagesError
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_memory import available_host_memory, empty_host, host_memory_for_pools
from tests.kv_oracle import serve

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
MLA_GEOMETRY = KVGeometry.mla(num_layers=3, latent_dim=6, dtype=torch.float32)
DEVICE_PAGES = 12


# Multi-turn style reuse: a few shared conversation heads, each request extending one.
HEADS = [[7, 1, 2, 3, 4, 5], [8] * 9, [9, 3] * 7, list(range(20, 36)), [1]]
prompts = st.lists(
    st.tuples(st.integers(0, len(HEADS) - 1), st.lists(st.integers(0, 3), max_size=8)).map(
        lambda pick: HEADS[pick[0]] + pick[1]
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.parametrize("geometry", [GEOMETRY, MLA_GEOMETRY], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", list(WritePolicy))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=prompts)
def test_cached_kv_equals_cold_kv_under_pressure(
    layout: MemLayout, page_size: int, policy: WritePolicy, geometry: KVGeometry,
    requests: list[list[int]],
) -> None:
    config = CacheConfig(
        page_size=page_size, enable_hierarchical_cache=True, hicache_ratio=2.0,
        write_policy=policy, io_backend=IOBackendKind.DIRECT, mem_layout=layout,
        load_back_threshold_tokens=1,
    )
    cache = HierarchicalCache(config, geometry, DEVICE_PAGES // page_size + 2)
    try:
        for tokens in requests:
            serve(cache, tokens)
        cache.poll(wait=True)
        cache.check_integrity()
    finally:
        cache.close()


def test_l2_hit_after_l1_eviction_is_loaded_back() -> None:
    config = CacheConfig(page_size=2, enable_hierarchical_cache=True, mem_layout="page_first",
                         io_backend="direct", load_back_threshold_tokens=1)
    cache = HierarchicalCache(config, GEOMETRY, device_num_pages=6)
    try:
        first = list(range(10))
        assert serve(cache, first) == 0
        cache.poll(wait=True)  # write-through copy has landed in L2
        assert cache.tree.num_host_pages == 5
        serve(cache, [50 + i for i in range(10)])  # needs the whole device pool: evicts `first`
        hit = cache.acquire(first)
        assert (hit.num_device_tokens, hit.num_host_tokens) == (0, 10)
        cache.release(hit)
        assert cache.controller is not None and cache.controller.load_seconds == 0.0
        assert serve(cache, first) == 10  # and the KV checks inside serve() pass
        assert cache.stats.num_host_hit_tokens >= 10
        # The copies' time is measured (a router prices host hits with it).
        assert cache.controller.load_seconds > 0
    finally:
        cache.close()


def test_check_integrity_names_a_page_owned_twice_or_owned_while_free() -> None:
    config = CacheConfig(page_size=1, enable_hierarchical_cache=True, io_backend="direct")
    cache = HierarchicalCache(config, GEOMETRY, device_num_pages=8)
    try:
        serve(cache, [1, 2, 3])
        cache.poll(wait=True)
        cache.check_integrity()
        allocator = cache.device_pool.allocator
        tree_pages = cache.tree.device_page_ids()
        with pytest.raises(AssertionError, match="two owners"):  # a request holds a tree page
            cache.check_integrity(held_device_pages=tree_pages[:1])
        free_page = next(p for p in range(allocator.num_pages) if not allocator.is_allocated(p))
        with pytest.raises(AssertionError, match="owned page is free"):
            cache.check_integrity(held_device_pages=np.array([free_page], dtype=np.int64))
    finally:
        cache.close()


def test_small_host_hits_are_recomputed_not_loaded() -> None:
    config = CacheConfig(page_size=1, enable_hierarchical_cache=True, io_backend="direct",
                         load_back_threshold_tokens=8)
    cache = HierarchicalCache(config, GEOMETRY, device_num_pages=8)
    try:
        serve(cache, [1, 2, 3])
        cache.poll(wait=True)
        serve(cache, list(range(100, 108)))  # evicts [1, 2, 3] to the host
        hit = cache.acquire([1, 2, 3, 4])
        assert hit.num_tokens == 0 and hit.node is cache.tree.root
        cache.release(hit)
        assert serve(cache, [1, 2, 3, 4]) == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_write_back_copies_only_on_eviction() -> None:
    config = CacheConfig(page_size=1, enable_hierarchical_cache=True, io_backend="direct",
                         write_policy="write_back", load_back_threshold_tokens=1)
    cache = HierarchicalCache(config, GEOMETRY, device_num_pages=6)
    try:
        serve(cache, [1, 2, 3, 4])
        serve(cache, [1, 2, 3, 4])
        assert cache.tree.num_host_pages == 0  # no copy while it stays on the device
        serve(cache, [9, 8, 7, 6])  # evicting [1..4] forces its copy to the host first
        assert cache.tree.num_host_pages >= 2
        assert serve(cache, [1, 2, 3, 4]) >= 2
    finally:
        cache.close()


def test_locked_prefix_is_never_evicted_and_pool_exhaustion_is_reported() -> None:
    config = CacheConfig(page_size=1, enable_hierarchical_cache=True, io_backend="direct")
    cache = HierarchicalCache(config, GEOMETRY, device_num_pages=4)
    try:
        serve(cache, [1, 2, 3, 4])
        hit = cache.acquire([1, 2, 3, 4])
        with pytest.raises(OutOfPagesError, match="locked"):
            cache.alloc_device(1)
        cache.release(hit)
        assert len(cache.alloc_device(1)) == 1
    finally:
        cache.close()


def test_invalid_configurations_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="--page-size"):
        CacheConfig(page_size=0)
    with pytest.raises(ConfigError, match="--hicache-mem-layout"):
        CacheConfig(mem_layout="row_major")
    with pytest.raises(ConfigError, match="greater than 1"):
        CacheConfig(enable_hierarchical_cache=True, hicache_ratio=1.0)
    with pytest.raises(ConfigError, match="--hicache-size"):
        HierarchicalCache(
            CacheConfig(enable_hierarchical_cache=True, hicache_size_gb=1e-6), GEOMETRY, 64
        )


def test_a_host_pool_larger_than_the_machines_memory_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = CacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0)
    page_bytes = GEOMETRY.page_bytes(config.page_size)
    assert config.host_num_pages(64, page_bytes, available_bytes=256 * page_bytes) == 256
    refused = r"more than the .* GB of memory this machine can spare .* --hicache-ratio"
    with pytest.raises(ConfigError, match=refused):
        config.host_num_pages(64, page_bytes, available_bytes=255 * page_bytes)
    # What the cache asks for is checked against what this machine has right now, less a
    # reserve for the rest of the process.
    available = available_host_memory()
    # One reading for the whole test: other processes change what is available between two.
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: available)
    spare = host_memory_for_pools()
    assert available is not None and spare is not None and 0 < spare < available
    assert available - spare == min(10 * 2**30, available // 4)
    huge = CacheConfig(enable_hierarchical_cache=True, hicache_size_gb=1.01 * spare / 1e9)
    with pytest.raises(ConfigError, match="--hicache-size below that"):
        HierarchicalCache(huge, GEOMETRY, 64)


def test_host_buffers_are_plain_memory_unless_pinned() -> None:
    flat = empty_host(1000, torch.bfloat16, pin=False)
    assert flat.shape == (1000,) and flat.dtype == torch.bfloat16 and not flat.is_pinned()
    assert flat.data_ptr() % 4096 == 0  # O_DIRECT L3 I/O into the pool needs it
    assert empty_host(0, torch.float32, pin=True).numel() == 0
