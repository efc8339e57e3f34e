"""Tenant quotas through the cache: backups of a tenant over its L3 quota evict only its
own oldest pages, and a new cache on the same file store gets exactly what each tenant
kept, computed from L3 equal to cold KV (the KV oracle), never another tenant's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.memory.geometry import KVGeometry
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.frame import HEADER_BYTES
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.kv_oracle import L3_WAIT_S, conversation, expected_kv, settle
from tests.l3_caches import l3_backend_of, make_l3_cache
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
PAGE = 4


def serve_as(cache: HierarchicalCache, tokens: list[int], tenant: str | None) -> int:
    """One request of ``tenant`` (its cache salt): prefetch from L3, reuse, check the reused
    KV equals cold KV, compute the rest; the tokens hit."""
    handle = cache.prefetch(tokens, tenant)
    if handle is not None:
        def ready() -> bool:
            cache.poll()
            return cache.prefetch_ready(handle)

        assert wait_until(ready, L3_WAIT_S, poll_s=0.001)
        cache.finish_prefetch(handle)
    hit = cache.acquire(tokens, tenant)
    for layer in range(GEOMETRY.num_layers):
        cache.wait_layer(layer)
    want = expected_kv(tokens, GEOMETRY, PAGE)
    cached = len(hit.device_pages)
    if cached:
        got = cache.device_pool.pages[torch.from_numpy(hit.device_pages)]
        assert torch.equal(got, want[:cached]), "cached KV differs from cold KV"
    fresh = cache.alloc_device(len(tokens) // PAGE - cached)
    cache.device_pool.pages[torch.from_numpy(fresh)] = want[cached:]
    cache.insert(tokens, np.concatenate([hit.device_pages, fresh]), tenant)
    cache.release(hit)
    settle(cache)
    return hit.num_tokens


def make_cache(root: Path, quotas: str) -> HierarchicalCache:
    return make_l3_cache("file", {"path": str(root)}, GEOMETRY, page_size=PAGE,
                         tenant_quotas=parse_tenant_quotas(quotas, "quotas.txt"))


def test_a_tenant_over_quota_loses_its_own_oldest_pages_only(tmp_path: Path) -> None:
    page_file = HEADER_BYTES + GEOMETRY.page_bytes(PAGE)
    quotas = f"acme l3={3 * page_file}\n"
    other, old, new = conversation(24, 1), conversation(12, 2), conversation(12, 3)
    first = make_cache(tmp_path, quotas)
    try:
        assert serve_as(first, other, "other") == 0
        assert serve_as(first, old, "acme") == 0
        assert serve_as(first, new, "acme") == 0  # evicts acme's older conversation
        backend = l3_backend_of(first, FileBackend)
        assert backend.tenant_usage() == {"other": 6 * page_file, "acme": 3 * page_file}
        assert first.storage is not None
        assert first.storage.controller.tenant_usage() == backend.tenant_usage()
    finally:
        first.close()

    second = make_cache(tmp_path, quotas)  # nothing local: every hit comes from L3
    try:
        assert serve_as(second, other, "other") == len(other)
        assert serve_as(second, new, "acme") == len(new)
        assert serve_as(second, old, "acme") == 0  # evicted for acme's quota
        assert serve_as(second, conversation(24, 1), "acme") == 0  # other's pages: not acme's
        assert second.storage is not None
        assert second.storage.controller.wait_idle(L3_WAIT_S)
    finally:
        second.close()
