"""HierarchicalCache on CUDA: streams, pinned host pool, both io backends, every layout.

KV served from L1 or loaded back from L2 must equal cold KV bit-for-bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.geometry import KVGeometry
from tests.kv_oracle import serve

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("io_backend", list(IOBackendKind))
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_cache_reuse_equals_cold(
    io_backend: IOBackendKind, layout: MemLayout, page_size: int, dtype: torch.dtype
) -> None:
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype=dtype)
    config = CacheConfig(
        page_size=page_size, enable_hierarchical_cache=True, hicache_ratio=3.0,
        write_policy=WritePolicy.WRITE_THROUGH, io_backend=io_backend, mem_layout=layout,
        load_back_threshold_tokens=1,
    )
    num_pages = 6  # requests take 4 pages: the pool overflows every other request
    cache = HierarchicalCache(config, geometry, num_pages, device="cuda")
    assert cache.controller is not None
    expected_backend = "kernel" if io_backend is IOBackendKind.KERNEL else "direct"
    assert cache.controller.io.name == expected_backend
    assert cache.host_pool is not None and cache.host_pool.pinned
    rng = random.Random(page_size)
    heads = [[rng.randrange(1000) for _ in range(page_size * 3)] for _ in range(4)]
    host_hits = 0
    try:
        for _ in range(16):
            tokens = rng.choice(heads) + [rng.randrange(1000) for _ in range(page_size)]
            before = cache.stats.num_host_hit_tokens
            serve(cache, tokens)
            host_hits += cache.stats.num_host_hit_tokens - before
        cache.poll(wait=True)
        cache.check_integrity()
    finally:
        cache.close()
    assert host_hits > 0, "the workload never loaded back from L2"
