"""The backend contract's tenant defaults: a backend that does not record tenants cannot
tell their usage and refuses to purge one, and keeps the quotas it is given."""

from __future__ import annotations

import pytest

from hicache.storage.base import StorageError
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.storage_reference import MemoryBackend, MemoryStore


def test_a_backend_without_tenants_cannot_tell_or_purge_them() -> None:
    backend = MemoryBackend(MemoryStore())
    assert backend.tenant_quotas is None
    assert backend.tenant_usage() is None
    with pytest.raises(StorageError, match="cannot list a tenant's pages"):
        backend.purge_tenant("acme")
    quotas = parse_tenant_quotas("acme l3=1GB\n", "quotas.txt")
    backend.set_tenant_quotas(quotas)
    assert backend.tenant_quotas is quotas
