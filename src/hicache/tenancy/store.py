"""What the cache asks an L3 store about one tenant: purge its objects, report its usage.

Invariant: the L3 controller (``storage.controller.StorageController``) answers both
for every backend: ``purge_tenant`` removes the tenant's objects where the backend
lists or names them and raises StorageError where it cannot (or not within
``timeout_s``); ``tenant_usage`` gives the bytes each tenant holds in the store, as far
as the backend knows. This module names that contract so the cache codes against it;
``tenant_store`` is the one place that views a controller through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, cast


class TenantStore(Protocol):
    def purge_tenant(self, tenant: str | None, timeout_s: float) -> int:
        """Remove every L3 object of ``tenant``; returns how many (StorageError: cannot)."""

    def tenant_usage(self) -> Mapping[str | None, int]:
        """Bytes each tenant holds in the store."""


def tenant_store(controller: object) -> TenantStore:
    """``controller`` seen through the tenant contract above."""
    return cast(TenantStore, controller)
