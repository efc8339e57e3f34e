"""Tenant quotas through the cache, on any L3 backend that enforces them: backups of a
tenant over its ``l3=`` quota evict only its own oldest pages, and a new cache on the
same store gets exactly what each tenant kept from L3, equal to cold KV (the KV oracle),
never another tenant's.

``make_cache(quotas)`` builds a write-through cache on the test's store with
``StorageConfig.tenant_quotas`` parsed from ``quotas``; two caches it builds share the store.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.memory.geometry import KVGeometry
from hicache.storage.base import StorageBackend
from hicache.storage.frame import HEADER_BYTES
from tests.kv_oracle import L3_WAIT_S, conversation, expected_kv, settle
from tests.l3_caches import l3_backend_of
from tests.waiting import wait_until

MakeCache = Callable[[str], HierarchicalCache]


def serve_as(cache: HierarchicalCache, tokens: list[int], tenant: str | None) -> int:
    """One request of ``tenant`` (its cache salt): prefetch from L3, reuse, check the reused
    KV equals cold KV, compute the rest, settle; the tokens hit."""
    geometry, page_size = cache.device_pool.geometry, cache.page_size
    handle = cache.prefetch(tokens, tenant)
    if handle is not None:
        def ready() -> bool:
            cache.poll()
            return cache.prefetch_ready(handle)

        assert wait_until(ready, L3_WAIT_S, poll_s=0.001)
        cache.finish_prefetch(handle)
    hit = cache.acquire(tokens, tenant)
    for layer in range(geometry.num_layers):
        cache.wait_layer(layer)
    want = expected_kv(tokens, geometry, page_size)
    cached = len(hit.device_pages)
    if cached:
        got = cache.device_pool.pages[torch.from_numpy(hit.device_pages)]
        assert torch.equal(got, want[:cached]), "cached KV differs from cold KV"
    fresh = cache.alloc_device(len(tokens) // page_size - cached)
    cache.device_pool.pages[torch.from_numpy(fresh)] = want[cached:]
    cache.insert(tokens, np.concatenate([hit.device_pages, fresh]), tenant)
    cache.release(hit)
    settle(cache)
    return hit.num_tokens


def check_a_tenant_over_quota_loses_its_own_oldest_pages_only(
    make_cache: MakeCache, geometry: KVGeometry, page_size: int,
) -> None:
    """Tenants of conversations of 24 and 12 tokens (pages of ``page_size`` = 4 tokens)."""
    assert page_size == 4
    page_object = HEADER_BYTES + geometry.page_bytes(page_size)
    quotas = f"acme l3={3 * page_object}\n"
    other, old, new = conversation(24, 1), conversation(12, 2), conversation(12, 3)
    first = make_cache(quotas)
    try:
        assert serve_as(first, other, "other") == 0
        assert serve_as(first, old, "acme") == 0
        assert serve_as(first, new, "acme") == 0  # evicts acme's older conversation
        backend = l3_backend_of(first, StorageBackend)
        assert backend.tenant_usage() == {"other": 6 * page_object, "acme": 3 * page_object}
        assert first.storage is not None
        assert first.storage.controller.tenant_usage() == backend.tenant_usage()
    finally:
        first.close()

    second = make_cache(quotas)  # nothing local: every hit comes from L3
    try:
        assert serve_as(second, other, "other") == len(other)
        assert serve_as(second, new, "acme") == len(new)
        assert serve_as(second, old, "acme") == 0  # evicted for acme's quota
        assert serve_as(second, conversation(24, 1), "acme") == 0  # other's pages: not acme's
    finally:
        second.close()
