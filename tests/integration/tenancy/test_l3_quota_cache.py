"""Tenant quotas through the cache on the file store (``tests/tenant_l3_cache_checks``)."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.memory.geometry import KVGeometry
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.config import StorageConfig
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.l3_caches import l3_backend_of, make_l3_cache
from tests.tenant_l3_cache_checks import check_a_tenant_over_quota_loses_its_own_oldest_pages_only

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_a_tenant_over_quota_loses_its_own_oldest_pages_only(tmp_path: Path) -> None:
    def make_cache(quotas: str) -> HierarchicalCache:
        return make_l3_cache("file", {"path": str(tmp_path)}, GEOMETRY, page_size=4,
                             tenant_quotas=parse_tenant_quotas(quotas, "quotas.txt"))

    check_a_tenant_over_quota_loses_its_own_oldest_pages_only(make_cache, GEOMETRY, 4)


def test_a_store_attached_later_enforces_the_servers_quotas(tmp_path: Path) -> None:
    """The admin attach endpoint builds its config from a backend name and JSON alone: the
    cache hands that store the quotas it was started with."""
    quotas = parse_tenant_quotas("acme l3=1\n", "quotas.txt")
    cache = make_l3_cache("file", {"path": str(tmp_path / "a")}, GEOMETRY, page_size=4,
                          tenant_quotas=quotas)
    try:
        assert l3_backend_of(cache, FileBackend).tenant_quotas is quotas
        cache.detach_storage()
        cache.attach_storage(StorageConfig(backend="file",
                                           backend_extra={"path": str(tmp_path / "b")}))
        assert l3_backend_of(cache, FileBackend).tenant_quotas is quotas
    finally:
        cache.close()
