"""The L3 storage backend contract.

An L3 backend stores KV pages under their chained page keys (``radix.keys``:
16 bytes, namespaced by model, KV geometry, page size and cache salt, so two
models or salts never share an object). It moves pages directly between its
store and pages of the host pool (L2); the device pool never talks to L3.

Every operation is batched and answers with a *prefix count*: how many of the
leading keys succeeded. A page chain is only usable up to its first gap, so a
backend may stop at the first miss. Backends never raise for a miss, a
corrupted object or an unreachable store: they count it in their stats and
return a shorter prefix. They raise ``StorageError`` only for misuse (a call
before ``attach``, mismatched argument lengths, a bad configuration).

Threading: the storage controller calls one backend from several threads at
once (one querying ``exists``, one reading with ``get``, one writing with
``set``, plus any call that outlived its deadline and is still running on its
abandoned thread); implementations must be safe for that. ``attach`` is never
called concurrently with anything else, nor ``close`` with a call the
controller still waits for (a detached tier closes its backend once every
stalled call has returned).

``set`` of a store that must be asked what it holds (Mooncake, Redis, LMCache,
AIBrix) is one skeleton, ``LookupPutBackend.set``: look the batch up, put only
the pages missing, count the pages written and skipped, answer the leading
stored prefix. Such a backend supplies only its transport steps: how a batch is
named, how the store is asked, how the missing pages are put.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.storage.failure_reasons import CountedReason, FailureReason

if TYPE_CHECKING:  # the pool is torch's; backends' settings and the router import this torch-free
    from hicache.memory.host_pool import HostPool
    from hicache.storage.sealing import Sealer
    from hicache.tenancy.quotas import TenantQuotas

PAGE_KEY_BYTES = 16
# Largest batch a backend is handed; callers split longer chains.
MAX_BATCH_PAGES = 128


class StorageError(Exception):
    """Misuse of a storage backend or an invalid configuration (not a miss or an outage)."""


@dataclass
class StorageStats:
    """Counters every backend keeps (read under its lock; copied out by ``stats()``)."""

    exists_queries: int = 0
    pages_read: int = 0
    pages_written: int = 0
    pages_skipped_existing: int = 0  # set() found them already stored
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    # Misses and failures by reason (``failure_reasons``: "missing", "corrupt", "io_error",
    # "evicted" ...), counted per page, keyed by the reason's value.
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: CountedReason, pages: int = 1) -> None:
        # Keyed by the value; a backend of the operator's own (``dynamic``) may count a
        # plain string of its own, which is its own key.
        key: str = getattr(reason, "value", reason)
        self.failures[key] = self.failures.get(key, 0) + pages

    def snapshot(self) -> StorageStats:
        copy = StorageStats(**{k: v for k, v in vars(self).items() if k != "failures"})
        copy.failures = dict(self.failures)
        return copy


class StorageBackend(ABC):
    """A store of KV pages keyed by 16-byte page keys. See the module docstring."""

    #: registry name ("file", "mooncake", ...)
    name: ClassVar[str] = ""

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        self.extra_config: dict[str, Any] = dict(extra_config or {})
        self._host: HostPool | None = None
        self._lock = threading.Lock()
        self._stats = StorageStats()
        # Set by a backend's close(); every later call is misuse (``_check_open``).
        self._closed = False
        # Seals every page written and opens every page read (``use_sealer``).
        self.sealer: Sealer | None = None
        # Whether the model's forward runs on this machine's CPU cores
        # (``forward_runs_on_cpu``); False until told.
        self.forward_on_cpu = False
        # ``--tenant-quotas``: what a backend that acts per tenant enforces of it (its
        # module docstring says what); None: no limits.
        self.tenant_quotas: TenantQuotas | None = None

    #: Whether the backend seals pages when given a sealer (``storage.sealing``): it
    #: builds and checks its frames through ``PageRegions(host, self.sealer)``.
    supports_sealing: ClassVar[bool] = False

    def use_sealer(self, sealer: Sealer) -> None:
        """Seal every page from now on (called before ``attach``). A backend that cannot
        refuses: it would write plaintext."""
        if not self.supports_sealing:
            raise StorageError(
                f"L3 storage backend {self.name!r} cannot encrypt pages "
                "(--l3-encryption-keys): use the file, redis or mooncake backend"
            )
        if self._host is not None:
            raise StorageError(f"{self.name} storage: a sealer is given before attach()")
        self.sealer = sealer

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        """Bind to the host pool pages will move to and from (register it for zero-copy).

        Called once, before any other operation. A backend that cannot reach its
        store raises ``StorageUnavailableError`` here so start-up can say so.
        """
        self._host = host

    @property
    def host(self) -> HostPool:
        if self._host is None:
            raise self._not_attached()
        return self._host

    @property
    def page_bytes(self) -> int:
        return self.host.page_bytes

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections and registrations; idempotent."""

    # ------------------------------------------------------------ operations
    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (0..len(keys))."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        """Read page ``keys[i]`` into host page ``host_pages[i]``, in order.

        Returns how many leading pages were read *and verified* (key and
        checksum). Host pages past the returned count may have been written
        with garbage and must not be used. A corrupted object is dropped from
        the store and counted as a failure.
        """

    @abstractmethod
    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        """Store host page ``host_pages[i]`` under ``keys[i]``, in order.

        Pages already stored are skipped (not rewritten) and count as stored.
        Returns how many leading pages are now stored. A stored object is
        complete or invisible: a reader never sees a torn page.
        """

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop the pages stored under ``keys``, found damaged after they were read (the
        cache verifies L3 pages' payload while loading them, ``memory.page_digests``), so
        that a later ``set`` stores them anew. Each counts as a "corrupt" failure; keys
        not stored are ignored; a store error is logged, never raised. Returns len(keys).
        """
        self._check_open(keys)
        if keys:
            self._fail(FailureReason.CORRUPT, len(keys))
            self._drop(keys)
        return len(keys)

    # ------------------------------------------------------------ pins
    #: Whether ``pin`` keeps pages: a backend that can pin sets it (``storage.controller``
    #: and the cache ask before pinning to L3). A wrapper sets it per instance, from what
    #: it wraps.
    supports_pins: bool = False

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> int:
        """Keep the pages of ``keys`` (stored, or stored later) from eviction until
        ``until_unix_s`` (wall clock, unix seconds), for every client of the store.
        Returns how many leading keys are pinned. A backend that cannot pin
        (``supports_pins`` False) raises ``StorageError``: calling it is misuse."""
        self._check_open(keys)
        raise StorageError(f"{self.name} storage cannot pin pages")

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Remove the pins of ``keys`` (keys without one are ignored); their pages are
        evictable again. Returns how many keys were unpinned: 0 for a backend that
        cannot pin (nothing is pinned there)."""
        self._check_open(keys)
        return 0

    def _drop(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Delete the objects of ``keys`` (for ``discard``). A backend that cannot delete
        leaves them: a damaged page then stays a miss, refused at every load."""

    # ------------------------------------------------------------ tenants
    def forward_runs_on_cpu(self, on_cpu: bool) -> None:
        """Where the model's forward runs (called before ``attach``): on this machine's CPU
        cores (True), whose time the backend's own work then takes from it, or elsewhere (a
        GPU). A backend may choose its I/O by it (the file backend's ``direct_writes``)."""
        self.forward_on_cpu = on_cpu

    # The tenant of a ``set``/``get``/``exists`` is ``call_tenant.current_tenant()``; a
    # backend that records it per object can report and remove a tenant's pages.
    def set_tenant_quotas(self, quotas: TenantQuotas | None) -> None:
        """Use ``quotas`` (L3 bytes and page age per tenant) from now on; called before
        ``attach``. A backend that cannot act per tenant ignores them (its docstring says)."""
        self.tenant_quotas = quotas

    def tenant_usage(self) -> dict[str | None, int] | None:
        """Bytes per tenant (None: the default tenant) of the pages this backend knows of,
        from what it keeps in memory (never a round trip to the store: the controller
        asks after every backup); None: this backend cannot tell."""
        return None

    def purge_tenant(self, tenant: str | None) -> int:
        """Remove every page of ``tenant`` from the store; returns how many objects were
        removed. Raises StorageError where the backend cannot list a tenant's pages."""
        raise StorageError(f"{self.name} cannot list a tenant's pages")

    @abstractmethod
    def clear(self) -> None:
        """Remove every page this backend's store holds (for its namespace/directory)."""

    def stats(self) -> StorageStats:
        with self._lock:
            return self._stats.snapshot()

    # ------------------------------------------------------------ helpers
    # Every backend counts the same way: a whole call's pages and time once it is done,
    # a failure as soon as it is seen (``failures`` reasons, per page).
    def _fail(self, reason: CountedReason, pages: int = 1) -> None:
        with self._lock:
            self._stats.fail(reason, pages)

    def _count_exists_query(self) -> None:
        with self._lock:
            self._stats.exists_queries += 1

    def _count_read(self, num_read: int, page_bytes: int, began: float) -> None:
        """A ``get`` that started at ``began`` (``time.perf_counter``) read ``num_read`` pages."""
        with self._lock:
            self._stats.pages_read += num_read
            self._stats.bytes_read += num_read * page_bytes
            self._stats.read_seconds += time.perf_counter() - began

    def _count_write(
        self, num_written: int, num_skipped: int, page_bytes: int, began: float
    ) -> None:
        """A ``set`` that started at ``began`` wrote ``num_written`` pages and skipped
        ``num_skipped`` found stored already."""
        with self._lock:
            self._stats.pages_skipped_existing += num_skipped
            self._stats.pages_written += num_written
            self._stats.bytes_written += num_written * page_bytes
            self._stats.write_seconds += time.perf_counter() - began

    def _check_attachable(self, attached: bool) -> None:
        """``attach`` is misuse after close() or a second time (``attached``)."""
        if self._closed:
            raise StorageError(f"{self.name} storage used after close()")
        if attached:
            raise StorageError(f"{self.name} storage is already attached")

    def _check_open(self, keys: Sequence[bytes], host_pages: PageIds | None = None) -> None:
        """What every operation checks first: not closed, and sound arguments."""
        if self._closed:
            raise StorageError(f"{self.name} storage used after close()")
        self._check_args(keys, host_pages)

    def _not_attached(self) -> StorageError:
        return StorageError(f"storage backend {self.name!r} used before attach()")

    def _check_args(self, keys: Sequence[bytes], host_pages: PageIds | None = None) -> None:
        if len(keys) > MAX_BATCH_PAGES:
            raise StorageError(f"a batch holds at most {MAX_BATCH_PAGES} pages, got {len(keys)}")
        for key in keys:
            if not isinstance(key, bytes) or len(key) != PAGE_KEY_BYTES:
                raise StorageError(f"page keys are {PAGE_KEY_BYTES} bytes, got {key!r}")
        if host_pages is not None:
            if len(host_pages) != len(keys):
                raise StorageError(
                    f"{len(keys)} keys but {len(host_pages)} host pages"
                )
            pages = np.asarray(host_pages)
            if len(pages) and (pages.min() < 0 or pages.max() >= self.host.num_pages):
                raise StorageError(
                    f"host pages must lie in [0, {self.host.num_pages}), "
                    f"got [{pages.min()}, {pages.max()}]"
                )


@dataclass
class PutBatch:
    """One ``set`` call's pages as the put skeleton hands them to a backend's steps;
    a backend extends it with what its steps share (client, object names ...)."""

    keys: Sequence[bytes]
    pages: list[int]  # the host page of each key
    page_bytes: int


BatchT = TypeVar("BatchT", bound=PutBatch)


class LookupPutBackend(StorageBackend, Generic[BatchT]):
    """A backend whose ``set`` is the put skeleton (module docstring): its store is
    looked up first and only the pages it lacks are put."""

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        batch = self._begin_put(keys, host_pages)
        if not keys:
            return 0
        began = time.perf_counter()
        found = self._lookup(batch)
        if found is None:  # the store could not be asked (counted): nothing is known stored
            return 0
        stored = list(found)
        todo = [i for i, done in enumerate(stored) if not done]
        num_written = self._put(batch, todo, stored) if todo else 0
        self._count_write(num_written, len(keys) - len(todo), batch.page_bytes, began)
        return first_gap(stored)

    @abstractmethod
    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> BatchT:
        """Check the call (misuse raises, as for every operation) and name its pages."""

    @abstractmethod
    def _lookup(self, batch: BatchT) -> list[bool] | None:
        """Which of the batch's pages the store holds, or None when it could not be
        asked (the failure counted)."""

    @abstractmethod
    def _put(self, batch: BatchT, todo: list[int], stored: list[bool]) -> int:
        """Put the pages ``todo`` (indices into the batch, in order; the store lacked
        them), setting ``stored[i]`` for each the store now holds and counting the
        first failure. May stop at the first page that failed. Returns how many pages
        it wrote (not those another writer stored meanwhile)."""


def first_gap(stored: Sequence[bool]) -> int:
    """How many leading pages are stored: a chain is usable only up to its first gap."""
    return next((i for i, done in enumerate(stored) if not done), len(stored))


class StorageUnavailableError(StorageError):
    """The store cannot be reached (at attach time); the server starts without L3."""
