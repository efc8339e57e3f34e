"""The "throttled" backend: any other backend behind a simulated latency and bandwidth.

A test and benchmark tool: it makes a fast local store (``file``) or a real remote one
(``redis``) behave like a slower or farther one, so that what depends on L3's speed (the
prefetch deadlines, the breaker, whether loading a hit beats recomputing it) can be
measured at chosen points, from faster than recompute to slower. It changes timing only:
every page, miss and failure is the wrapped backend's.

Extra config:
    backend           name of the backend to wrap (required; any registered one but this)
    backend_extra     that backend's own extra config (default {})
    read_latency_ms   added to every ``get`` and ``exists`` (default 0)
    read_bandwidth    bytes per second a ``get``'s pages go through at (an int or a size
                      such as "200MB" or "1GiB"; default null: no limit)
    write_latency_ms  added to every ``set`` (default 0)
    write_bandwidth   as read_bandwidth, for the pages a ``set`` is handed

Invariants:
- A call runs on the wrapped backend first, then waits on the calling (io) thread,
  never on the scheduler's: ``get`` its read latency plus the bytes of the pages it read
  (a miss moves nothing) at the read bandwidth; ``exists`` the read latency only; ``set``
  the write latency plus the bytes of every page it was handed (pages the wrapped store
  skips as already stored are charged too: which were skipped cannot be told apart from
  other calls' counts). An empty batch, ``discard``, ``clear``, ``pin`` and ``unpin``
  are not delayed; the pins are the wrapped backend's (``supports_pins`` too).
- Bandwidth is per instance and direction, shared by parallel calls; latency is per call
  (``link.Link``). The wait holds no lock, so a call past its deadline is abandoned like
  one to a slow real store, and the controller's stall handling and breaker see exactly
  that.
- Misuse (before ``attach``, after ``close``, bad arguments) is the wrapped backend's
  error, raised before any wait. ``stats()`` are the wrapped backend's, with the waits
  of ``get`` and ``set`` added to ``read_seconds`` and ``write_seconds`` (what the caller
  saw).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.throttled.link import Link
from hicache.storage.backends.throttled.settings import NAME, ThrottledSettings
from hicache.storage.base import StorageBackend, StorageStats
from hicache.storage.options import read_settings
from hicache.storage.registry import create_storage_backend
from hicache.tenancy.quotas import TenantQuotas

_MS = 1e-3


class ThrottledBackend(StorageBackend):
    """See the module docstring."""

    name = NAME

    def __init__(
        self,
        extra_config: Mapping[str, Any] | None = None,
        *,
        inner: StorageBackend | None = None,
        read_link: Link | None = None,
        write_link: Link | None = None,
    ) -> None:
        """``inner``, ``read_link`` and ``write_link`` replace what the extra config would
        build (tests: a test double behind links on a fake clock)."""
        super().__init__(extra_config)
        settings = read_settings(ThrottledSettings, self.extra_config, f"{NAME} storage")
        # ``is None``, not ``or``: a backend may define __len__ (the file backend's page
        # count), and an empty one is falsy.
        if read_link is None:
            read_link = Link(settings.read_latency_ms * _MS, settings.read_bandwidth)
        if write_link is None:
            write_link = Link(settings.write_latency_ms * _MS, settings.write_bandwidth)
        if inner is None:
            inner = create_storage_backend(settings.backend, settings.backend_extra)
        self.read_link, self.write_link, self.inner = read_link, write_link, inner
        self.supports_pins = inner.supports_pins
        self._read_wait_s = 0.0  # guarded by self._lock
        self._write_wait_s = 0.0

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self.inner.attach(host)
        super().attach(host)

    def close(self) -> None:
        self._closed = True
        self.inner.close()

    # ------------------------------------------------------------ operations
    def exists(self, keys: Sequence[bytes]) -> int:
        found = self.inner.exists(keys)
        if keys:  # an empty batch asks the store nothing
            self.read_link.delay(0)  # not read time: stats count lookups, not their time
        return found

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        num_read = self.inner.get(keys, host_pages)
        if keys:
            self._count_wait(read=self.read_link.delay(num_read * self.page_bytes))
        return num_read

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        stored = self.inner.set(keys, host_pages)
        if keys:
            self._count_wait(write=self.write_link.delay(len(keys) * self.page_bytes))
        return stored

    def discard(self, keys: Sequence[bytes]) -> int:
        return self.inner.discard(keys)

    def clear(self) -> None:
        self.inner.clear()

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> int:
        return self.inner.pin(keys, until_unix_s)

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self.inner.unpin(keys)

    def forward_runs_on_cpu(self, on_cpu: bool) -> None:
        super().forward_runs_on_cpu(on_cpu)
        self.inner.forward_runs_on_cpu(on_cpu)

    # Tenants are the inner store's (it reads the call's tenant itself).
    def set_tenant_quotas(self, quotas: TenantQuotas | None) -> None:
        super().set_tenant_quotas(quotas)
        self.inner.set_tenant_quotas(quotas)

    def tenant_usage(self) -> dict[str | None, int] | None:
        return self.inner.tenant_usage()

    def purge_tenant(self, tenant: str | None) -> int:
        return self.inner.purge_tenant(tenant)

    def stats(self) -> StorageStats:
        stats = self.inner.stats()
        with self._lock:
            stats.read_seconds += self._read_wait_s
            stats.write_seconds += self._write_wait_s
        return stats

    def _count_wait(self, read: float = 0.0, write: float = 0.0) -> None:
        with self._lock:
            self._read_wait_s += read
            self._write_wait_s += write
