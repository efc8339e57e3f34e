"""Which tenant each known L3 object belongs to, in least recently used order per tenant.

A backend that acts per tenant (``--tenant-quotas``: quotas, usage, purge) keeps one:
the file backend for every page in its directory it knows of, the Redis and Mooncake
backends for the pages this instance wrote. Not thread-safe: the owner guards it with
its lock.

Invariants: an object name belongs to one tenant at a time; ``bytes_of(t)`` is the sum
of the sizes of ``t``'s names; each tenant's order runs from least to most recently used.
A name added with its write time (``written_s``) is also in its tenant's write order,
oldest write first, until it is removed (``expired`` reads that order: a TTL counted
from the write, for stores that set no expiry of their own).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator

from hicache.tenancy.names import within_tenant


class TenantPages:
    """See the module docstring."""

    def __init__(self) -> None:
        self._orders: dict[str | None, OrderedDict[str, int]] = {}
        self._tenant: dict[str, str | None] = {}
        self._bytes: dict[str | None, int] = {}
        # Write times (monotonic seconds) per tenant, oldest write first.
        self._writes: dict[str | None, OrderedDict[str, float]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tenant

    def __len__(self) -> int:
        return len(self._tenant)

    def add(self, name: str, tenant: str | None, size: int,
            written_s: float | None = None) -> None:
        """Record ``name`` as ``tenant``'s, the most recently used (replacing any record);
        ``written_s``: when it was written (monotonic), for ``expired``."""
        self.remove(name)
        self._tenant[name] = tenant
        self._orders.setdefault(tenant, OrderedDict())[name] = size
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        if written_s is not None:
            self._writes.setdefault(tenant, OrderedDict())[name] = written_s

    def remove(self, name: str) -> tuple[str | None, int] | None:
        """Forget ``name``; its (tenant, size), or None when it was not recorded."""
        if name not in self._tenant:
            return None
        tenant = self._tenant.pop(name)
        order = self._orders[tenant]
        size = order.pop(name)
        self._bytes[tenant] -= size
        if not order:
            del self._orders[tenant], self._bytes[tenant]
        writes = self._writes.get(tenant)
        if writes is not None and writes.pop(name, None) is not None and not writes:
            del self._writes[tenant]
        return tenant, size

    def expired(self, tenant: str | None, ttl_s: float, now_s: float) -> list[str]:
        """Forget ``tenant``'s names written more than ``ttl_s`` before ``now_s``, and
        return them (for the caller to delete from its store). O(expired names)."""
        victims: list[str] = []
        writes = self._writes.get(tenant)
        while writes:
            name, written = next(iter(writes.items()))
            if now_s - written <= ttl_s:
                break  # written in order: the rest are younger
            victims.append(name)
            self.remove(name)
            writes = self._writes.get(tenant)
        return victims

    def is_expired(self, name: str, ttl_s: float, now_s: float) -> bool:
        """Whether recorded ``name`` was written more than ``ttl_s`` before ``now_s``
        (False when it is not recorded or its write time is unknown)."""
        if name not in self._tenant:
            return False
        writes = self._writes.get(self._tenant[name])
        written = None if writes is None else writes.get(name)
        return written is not None and now_s - written > ttl_s

    def tenant_of(self, name: str) -> str | None:
        """The tenant of a recorded ``name`` (KeyError when it is not recorded)."""
        return self._tenant[name]

    def touch(self, name: str) -> None:
        """``name`` was used: it becomes its tenant's most recently used."""
        if name in self._tenant:
            self._orders[self._tenant[name]].move_to_end(name)

    def demote(self, name: str) -> None:
        """``name`` becomes its tenant's least recently used."""
        if name in self._tenant:
            self._orders[self._tenant[name]].move_to_end(name, last=False)

    def oldest(self, tenant: str | None) -> Iterator[tuple[str, int]]:
        """``tenant``'s (name, size), least recently used first (a copy: safe to remove
        while iterating)."""
        return iter(list(self._orders.get(tenant, {}).items()))

    def evict_for(
        self, tenant: str | None, count: int, object_bytes: int, limit: int,
        keep: Collection[str],
    ) -> tuple[list[str], int]:
        """Make room in ``tenant``'s quota of ``limit`` bytes for ``count`` new objects of
        ``object_bytes``: forget its least recently used objects (never one in ``keep``:
        the batch being written) until they fit or none is left. Returns the names
        forgotten, for the caller to delete from its store, and how many of the ``count``
        fit then."""
        victims: list[str] = []
        used = self.bytes_of(tenant)
        for name, size in self.oldest(tenant):
            if used + count * object_bytes <= limit:
                break
            if name not in keep:
                victims.append(name)
                self.remove(name)
                used -= size
        return victims, max(0, min(count, (limit - used) // object_bytes))

    def least_recent(self, tenant: str | None, count: int) -> list[str]:
        """Up to ``count`` of ``tenant``'s names, least recently used first."""
        return list(itertools.islice(self._orders.get(tenant, ()), count))

    def names(self, tenant: str | None) -> list[str]:
        return list(self._orders.get(tenant, ()))

    def forget_tenant(self, tenant: str | None) -> None:
        """Drop the names of ``tenant`` and of the namespaces nested in it (a purge)."""
        for owner in [t for t in self._orders if within_tenant(t, tenant)]:
            for name in self.names(owner):
                self.remove(name)

    def bytes_of(self, tenant: str | None) -> int:
        return self._bytes.get(tenant, 0)

    def usage(self) -> dict[str | None, int]:
        """Bytes per tenant that has any object."""
        return dict(self._bytes)

    def clear(self) -> None:
        self._orders.clear()
        self._tenant.clear()
        self._bytes.clear()
        self._writes.clear()
