"""Tenant quotas through the cache on the file store (``tests/tenant_l3_cache_checks``)."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.memory.geometry import KVGeometry
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.l3_caches import make_l3_cache
from tests.tenant_l3_cache_checks import check_a_tenant_over_quota_loses_its_own_oldest_pages_only

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_a_tenant_over_quota_loses_its_own_oldest_pages_only(tmp_path: Path) -> None:
    def make_cache(quotas: str) -> HierarchicalCache:
        return make_l3_cache("file", {"path": str(tmp_path)}, GEOMETRY, page_size=4,
                             tenant_quotas=parse_tenant_quotas(quotas, "quotas.txt"))

    check_a_tenant_over_quota_loses_its_own_oldest_pages_only(make_cache, GEOMETRY, 4)
