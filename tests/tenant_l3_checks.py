"""Per-tenant checks any L3 backend that records tenants passes (file, Redis, Mooncake):
quotas evict only the tenant's own pages, usage is per tenant, a purge removes one
tenant's pages (including another instance's), and tenants never see each other's pages.

``open_backend(quotas_text)`` returns an attached backend on a store of the test's own;
two backends it returns share that store."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hicache.memory.geometry import KVGeometry
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.base import StorageBackend
from hicache.storage.call_tenant import call_tenant
from hicache.storage.frame import HEADER_BYTES
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.storage_contract import as_bytes, fill_random

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 4
HOST_PAGES = 16
NAMESPACE = KeyNamespace("tenant-l3-checks", GEOMETRY.describe(), PAGE)
OpenBackend = Callable[[str | None], StorageBackend]


def keys_of(tenant: str | None, count: int, start: int = 0) -> list[bytes]:
    tokens = np.arange(start, start + count * PAGE) + 11
    return chain_page_keys(pack_tokens(tokens), PAGE, NAMESPACE.seed(tenant))


def with_quotas(backend: StorageBackend, text: str | None) -> StorageBackend:
    if text is not None:
        backend.set_tenant_quotas(parse_tenant_quotas(text, "quotas.txt"))
    return backend


def object_bytes(backend: StorageBackend) -> int:
    return HEADER_BYTES + backend.page_bytes


def put(backend: StorageBackend, tenant: str | None, keys: list[bytes], first: int = 0) -> int:
    with call_tenant(tenant):
        return backend.set(keys, np.arange(first, first + len(keys)))


def found(backend: StorageBackend, tenant: str | None, keys: list[bytes]) -> list[bool]:
    with call_tenant(tenant):
        return [backend.exists([key]) == 1 for key in keys]


def check_quota_evicts_only_the_tenants_own_oldest(open_backend: OpenBackend) -> None:
    probe = open_backend(None)
    size = object_bytes(probe)
    probe.close()
    backend = open_backend(f"acme l3={3 * size}\n")
    try:
        acme, other = keys_of("acme", 5), keys_of("other", 4)
        assert put(backend, "acme", acme[:3]) == 3
        assert put(backend, "other", other) == 4
        with call_tenant("acme"):  # read: acme's first page becomes its most recently used
            assert backend.get(acme[:1], np.arange(8, 9)) == 1
        assert put(backend, "acme", acme[3:5], first=3) == 2
        assert found(backend, "acme", acme) == [True, False, False, True, True]
        assert found(backend, "other", other) == [True] * 4
        assert backend.tenant_usage() == {"acme": 3 * size, "other": 4 * size}
        assert backend.stats().failures["evicted_tenant_quota"] == 2
        # A batch never evicts its own pages: what does not fit is refused.
        fresh = keys_of("acme", 4, start=1000)
        assert put(backend, "acme", fresh) == 3
        assert found(backend, "acme", fresh) == [True, True, True, False]
        assert backend.stats().failures["tenant_quota_full"] == 1
        assert found(backend, "other", other) == [True] * 4
    finally:
        backend.close()


def check_tenants_are_isolated_and_read_back_exactly(open_backend: OpenBackend) -> None:
    backend = open_backend(None)
    try:
        keys = keys_of("acme", 2)
        expected = as_bytes(fill_random(backend.host, np.arange(2), seed=5))
        assert put(backend, "acme", keys) == 2
        assert found(backend, "other", keys) == [False, False]  # same keys, other tenant
        assert found(backend, None, keys) == [False, False]
        with call_tenant("acme"):
            assert backend.get(keys, np.arange(4, 6)) == 2
        assert as_bytes(backend.host.pages[4:6]) == expected
    finally:
        backend.close()


def check_purge_removes_one_tenants_pages_of_every_instance(open_backend: OpenBackend) -> None:
    first, second = open_backend(None), open_backend(None)
    try:
        size = object_bytes(first)
        acme, other, plain = keys_of("acme", 3), keys_of("other", 2), keys_of(None, 2)
        # Namespaces nested in acme (a salt under it, an extra key under that salt) go
        # with it; a tenant whose name only starts the same way does not.
        salted, extra = keys_of("acme/s1", 2), keys_of("acme/s1\x00e", 1)
        lookalike = keys_of("acme2", 1)
        assert put(first, "acme", acme) == 3
        assert put(first, "acme/s1", salted) == 2
        assert put(first, "acme/s1\x00e", extra) == 1
        assert put(first, "acme2", lookalike) == 1
        assert put(first, "other", other) == 2
        assert put(first, None, plain) == 2
        assert first.tenant_usage() == {
            "acme": 3 * size, "acme/s1": 2 * size, "acme/s1\x00e": size, "acme2": size,
            "other": 2 * size, None: 2 * size,
        }
        assert second.purge_tenant("acme") == 6  # pages the first instance wrote
        assert found(first, "acme", acme) == [False] * 3
        assert found(first, "acme/s1", salted) == [False] * 2
        assert found(first, "acme/s1\x00e", extra) == [False]
        assert found(first, "acme2", lookalike) == [True]
        assert found(first, "other", other) == [True] * 2
        assert found(first, None, plain) == [True] * 2
        assert first.purge_tenant("acme") == 0
        assert first.tenant_usage() == {"acme2": size, "other": 2 * size, None: 2 * size}
        assert first.purge_tenant(None) == 2
        assert found(second, None, plain) == [False] * 2
        assert found(second, "other", other) == [True] * 2
        assert found(second, "acme2", lookalike) == [True]
    finally:
        first.close()
        second.close()
