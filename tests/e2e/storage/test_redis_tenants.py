"""The redis backend per tenant against a real redis-server: quotas, usage, purge,
isolation (``tests/tenant_l3_checks``), per-tenant TTLs as key expiries, and clear()."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.storage.base import StorageBackend
from hicache.storage.call_tenant import call_tenant
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.l3_caches import make_l3_cache
from tests.redis_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    server_fixture,
)
from tests.tenant_l3_cache_checks import check_a_tenant_over_quota_loses_its_own_oldest_pages_only
from tests.tenant_l3_checks import (
    GEOMETRY,
    HOST_PAGES,
    PAGE,
    OpenBackend,
    check_purge_removes_one_tenants_pages_of_every_instance,
    check_quota_evicts_only_the_tenants_own_oldest,
    check_tenants_are_isolated_and_read_back_exactly,
    found,
    keys_of,
    put,
    with_quotas,
)
from tests.waiting import wait_until

CACHE_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


@pytest.fixture
def open_backend(redis_extra: dict[str, Any]) -> Iterator[OpenBackend]:
    opened: list[StorageBackend] = []

    def open_one(quotas: str | None) -> StorageBackend:
        backend = with_quotas(RedisBackend(redis_extra), quotas)
        backend.attach(HostPool(GEOMETRY, HOST_PAGES, PAGE, MemLayout.PAGE_FIRST,
                                pin_memory=False))
        opened.append(backend)
        return backend

    yield open_one
    for backend in opened:
        backend.close()


def test_quota_evicts_only_the_tenants_own_oldest(open_backend: OpenBackend) -> None:
    check_quota_evicts_only_the_tenants_own_oldest(open_backend)


def test_tenants_are_isolated(open_backend: OpenBackend) -> None:
    check_tenants_are_isolated_and_read_back_exactly(open_backend)


def test_purge_removes_one_tenants_pages(open_backend: OpenBackend) -> None:
    check_purge_removes_one_tenants_pages_of_every_instance(open_backend)


def test_a_tenants_ttl_is_its_keys_expiry(open_backend: OpenBackend) -> None:
    backend = open_backend("acme l3_ttl=600\n")
    assert isinstance(backend, RedisBackend)
    acme, other = keys_of("acme", 1), keys_of("other", 1)
    assert put(backend, "acme", acme) == 1
    assert put(backend, "other", other) == 1
    client = backend.raw_client
    assert 0 < client.pttl(backend.key_of(acme[0], "acme")) <= 600_000
    assert client.pttl(backend.key_of(other[0], "other")) == -1  # no TTL for "other"
    # Expired by Redis (as after 600 s): a miss, and forgotten by the usage at the read.
    assert client.pexpire(backend.key_of(acme[0], "acme"), 1)
    assert wait_until(lambda: found(backend, "acme", acme) == [False], 10.0)
    with call_tenant("acme"):
        assert backend.get(acme, np.arange(1)) == 0
    assert "acme" not in backend.tenant_usage()


def test_clear_removes_every_tenants_pages(open_backend: OpenBackend) -> None:
    backend = open_backend(None)
    assert put(backend, "acme", keys_of("acme", 2)) == 2
    assert put(backend, None, keys_of(None, 2)) == 2
    backend.clear()
    assert found(backend, "acme", keys_of("acme", 2)) == [False, False]
    assert found(backend, None, keys_of(None, 2)) == [False, False]
    assert backend.tenant_usage() == {}


def test_through_the_cache_a_tenant_over_quota_loses_only_its_own_pages(
    redis_extra: dict[str, Any],
) -> None:
    def make_cache(quotas: str) -> HierarchicalCache:
        return make_l3_cache("redis", redis_extra, CACHE_GEOMETRY, page_size=4,
                             tenant_quotas=parse_tenant_quotas(quotas, "quotas.txt"))

    check_a_tenant_over_quota_loses_its_own_oldest_pages_only(make_cache, CACHE_GEOMETRY, 4)
