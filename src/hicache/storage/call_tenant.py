"""The tenant a backend call is made for, readable by the backend during the call.

A page's tenant is its cache salt (the tree node's ``extra_key``; None: the default
tenant). The page keys a backend receives are hashes that do not reveal it, and the
backend contract (``set``/``get``/``exists`` of keys and host pages) does not carry it,
so the storage controller sets it around each call, on the thread that runs the call
(``StorageController._call``), for the backends that act per tenant (sealing pages with
the tenant's key, per-tenant quotas). One operation (a node's backup, a request's
prefetch) is always one tenant's.

Invariants: outside a call ``current_tenant()`` is None; a call's tenant is visible only
on the thread running it, and is restored when the call returns or raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def current_tenant() -> str | None:
    """The tenant of the backend call running on this thread (None: the default one)."""
    tenant: str | None = getattr(_local, "tenant", None)
    return tenant


@contextmanager
def call_tenant(tenant: str | None) -> Iterator[None]:
    """Run a backend call for ``tenant`` on this thread."""
    previous = getattr(_local, "tenant", None)
    _local.tenant = tenant
    try:
        yield
    finally:
        _local.tenant = previous
