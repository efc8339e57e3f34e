"""The mooncake backend per tenant against a real mooncake_master: quotas, usage, purge
and isolation (``tests/tenant_l3_checks``), and clear() of every tenant's objects."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.base import StorageBackend
from hicache.storage.call_tenant import call_tenant
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.l3_caches import make_l3_cache
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    extra_fixture,
    master_fixture,
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
    object_bytes,
    put,
    with_quotas,
)

CACHE_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


@pytest.fixture
def open_backend(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend
) -> Iterator[OpenBackend]:
    # One master for the module: each test starts from an empty store.
    mooncake_anchor.clear()
    opened: list[StorageBackend] = []

    def open_one(quotas: str | None) -> StorageBackend:
        backend = with_quotas(MooncakeBackend(mooncake_extra), quotas)
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


def test_a_tenants_ttl_removes_what_this_instance_wrote_past_it(
    open_backend: OpenBackend,
) -> None:
    first, second = open_backend("acme l3_ttl=600\n"), open_backend(None)
    assert isinstance(first, MooncakeBackend)
    now = [1000.0]
    first.clock = lambda: now[0]
    size = object_bytes(first)
    acme, other = keys_of("acme", 2), keys_of("other", 1)
    assert put(first, "acme", acme) == 2
    assert put(first, "other", other) == 1
    now[0] += 599.0  # within the TTL: found
    assert found(first, "acme", acme) == [True, True]
    now[0] += 2.0  # past it: a miss from the first page on, for lookups and reads alike
    assert found(first, "acme", acme) == [False, False]
    with call_tenant("acme"):
        assert first.get(acme, np.arange(2)) == 0
    # The tenant's next backup removes every object of its past the TTL from the store
    # (another instance finds none of them), and no other tenant's.
    fresh = keys_of("acme", 1, start=100)
    assert put(first, "acme", fresh) == 1
    assert found(second, "acme", acme) == [False, False]
    assert found(second, "acme", fresh) == [True]
    assert found(second, "other", other) == [True]
    assert first.tenant_usage() == {"acme": size, "other": size}


def test_clear_removes_every_tenants_objects(open_backend: OpenBackend) -> None:
    backend = open_backend(None)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    assert put(backend, tenant, keys_of(tenant, 2)) == 2
    assert put(backend, None, keys_of(None, 2)) == 2
    backend.clear()
    assert found(backend, tenant, keys_of(tenant, 2)) == [False, False]
    assert found(backend, None, keys_of(None, 2)) == [False, False]
    assert backend.tenant_usage() == {}


def test_through_the_cache_a_tenant_over_quota_loses_only_its_own_pages(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend,
) -> None:
    mooncake_anchor.clear()

    def make_cache(quotas: str) -> HierarchicalCache:
        return make_l3_cache("mooncake", mooncake_extra, CACHE_GEOMETRY, page_size=4,
                             tenant_quotas=parse_tenant_quotas(quotas, "quotas.txt"))

    check_a_tenant_over_quota_loses_its_own_oldest_pages_only(make_cache, CACHE_GEOMETRY, 4)
