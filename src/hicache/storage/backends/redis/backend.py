"""The "redis" backend: pages in a Redis server (or Valkey, which speaks the same protocol).

Every instance given the same server and ``prefix`` shares one pool of pages.
It talks to one server (a standalone Redis or a primary), not to Redis Cluster.
Redis keeps them in memory; how much it may use and what it drops when full
is the server's choice, not ours: with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` Redis is an LRU L3 (an evicted page is a
miss, recomputed and backed up again); with the default ``noeviction`` a full
server refuses writes (``no_space``) and keeps what it has.

Extra config:
    url                redis://[user:password@]host:port/db (default
                       redis://127.0.0.1:6379/0), rediss://... for TLS, or
                       unix:///path/to/redis.sock?db=0
    prefix             prepended to every key (default "hicache:"), so caches or other
                       applications can share one server; clear() removes only this
                       prefix's page keys
    ttl_s              expire each page this many seconds after it is stored (default:
                       never; a page found already stored keeps its first expiry)
    max_batch_bytes    most page bytes one pipeline carries (default 64 MiB); a batch is
                       sent in as many pipelines as it needs
    connect_timeout_s  how long a connection attempt may take (default 1 s)
    socket_timeout_s   how long the server may leave one read or write unanswered
                       (default 2 s)
    max_connections    size of the connection pool shared by the storage threads (32)
    verify_checksum    hash every page read against its header (default true)

Object format. A page is one string value under ``<prefix><frame.object_name>``
(the namespaced key in hex and the payload-order tag, as the file and Mooncake
backends name theirs), holding ``payload || header`` (``frame``). One SET
stores the whole value, so a reader sees a complete page or none. A reader
checks the length, the header's key and length, and the checksum; a page that
fails is a miss counted under its ``frame.Fault`` reason and is deleted, so
the next backup stores it again.

Transfers. ``exists`` pipelines one EXISTS per page, ``get`` reads pages with
MGET and ``set`` pipelines SET ... NX (with PX when ``ttl_s`` is set). Before
writing, ``set`` asks which pages are stored already (pipelined EXISTS) and
sends only the others: resending a page of megabytes to be refused by NX
costs far more than a round trip of small replies (32 stored pages of 8 MiB:
0.6 ms to skip, 740 ms to resend), while the EXISTS costs a new page about
one round trip; NX still keeps a page that another instance stored meanwhile
from being rewritten. A SET's value goes to the socket straight from the
page's regions in the host pool and its header (``wire``: no copy);
on the way in, the payload is copied from MGET's reply into the page's
regions once it is verified (a sealed page is decrypted from the reply into
them instead: the decryption is the copy, ``PageRegions.land``).

Failures. The client retries a failed command once at once (a pooled
connection the server closed, e.g. after a restart, is reconnected), then
the batch is a miss: "unreachable" when no connection could be made or kept,
"timeout" past ``socket_timeout_s``, "no_space" when a server without
eviction is full, "io_error" otherwise. Nothing is raised: the storage
controller's breaker sees the failures and stops calling for a while, and
calls go through again once the server is back. On loopback a server that is
gone refuses connections at once, so a call fails in well under a second; a
remote host that drops packets costs ``connect_timeout_s`` per call until the
breaker opens. A server that cannot be reached at attach is a
``StorageUnavailableError``.

Tenants (``call_tenant.current_tenant()`` of each call). The default tenant's pages are
named as above; tenant ``t``'s are ``<prefix>t<32 hex>:<frame.object_name>``, the hex a
hash of the tenant (``file.tenant_dirs.tenant_dir_name``), so a lookup only ever finds
the calling tenant's pages; a namespace nested in ``t`` (``t/salt``) adds its own
``t<32 hex>:`` after ``t``'s (``tenant_key_prefix``), so ``purge_tenant`` removes a
tenant's pages and its nested namespaces' by one SCAN of its names, whichever instance
wrote them. With ``--tenant-quotas``:
- ``l3_ttl=``: the tenant's pages are SET with that expiry (PX; it replaces ``ttl_s``
  for them): Redis itself drops them, counted from when each was written.
- ``l3=``: enforced on the pages *this instance* wrote (it keeps their bytes per tenant,
  least recently written or read first): a backup that would take the tenant past its
  quota first deletes the tenant's oldest such pages, never another tenant's nor one of
  the same batch; the pages that still do not fit are refused ("tenant_quota_full").
  It cannot count pages other instances wrote, nor see what Redis evicted or expired
  on its own (a page found missing on read is forgotten): with several instances a
  tenant may hold up to the sum of their quotas.
``tenant_usage`` reports those per-instance counts.
A namespace nested in a tenant (``tenancy.names.within_tenant``: a salt under it, an extra
key inside its salt) is named under the tenant's prefix, so ``purge_tenant(t)`` removes it
with ``t``'s pages (and a tenant whose name merely starts like ``t``'s keeps its own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.tenant_dirs import tenant_key_prefix
from hicache.storage.backends.redis.settings import RedisSettings
from hicache.storage.backends.redis.wire import pipelined, set_command
from hicache.storage.base import (
    LookupPutBackend,
    PutBatch,
    StorageError,
    StorageUnavailableError,
    first_gap,
)
from hicache.storage.call_tenant import current_tenant
from hicache.storage.failure_reasons import FailureReason
from hicache.storage.frame import length_fault, object_name
from hicache.storage.options import read_settings
from hicache.storage.page_regions import PageRegions
from hicache.storage.tenant_pages import TenantPages

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Keys deleted per UNLINK by clear(), and asked for per SCAN step.
_CLEAR_CHUNK = 512
_GLOB_SPECIAL = "\\*?[]"


@dataclass
class _RedisPut(PutBatch):
    client: redis.Redis
    regions: PageRegions
    names: list[bytes]
    tenant: str | None


class RedisBackend(LookupPutBackend[_RedisPut]):
    """See the module docstring."""

    name = "redis"
    supports_sealing = True

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.settings = read_settings(RedisSettings, self.extra_config, "redis storage")
        self._prefix = self.settings.prefix.encode()
        self._ttl_ms = (
            None if self.settings.ttl_s is None else max(1, round(self.settings.ttl_s * 1000))
        )
        self._client: redis.Redis | None = None
        self._regions: PageRegions | None = None
        # The pages this instance wrote, by tenant (quotas, usage). Guarded by self._lock.
        self._pages = TenantPages()

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self._check_attachable(self._client is not None)
        regions = PageRegions(host, self.sealer)
        settings = self.settings
        try:
            pool = redis.ConnectionPool.from_url(
                settings.url,
                socket_connect_timeout=settings.connect_timeout_s,
                socket_timeout=settings.socket_timeout_s,
                max_connections=settings.max_connections,
                # One immediate retry: reconnects a pooled connection the server closed.
                retry=Retry(NoBackoff(), 1),
            )
        except ValueError as error:  # a url redis-py cannot parse
            raise StorageError(
                f"redis storage: bad url {settings.display_url!r}: {error}"
            ) from error
        client = redis.Redis(connection_pool=pool)
        try:
            client.ping()
        except (redis.RedisError, OSError) as error:
            pool.disconnect()
            raise StorageUnavailableError(
                f"redis storage: the server at {settings.display_url} cannot be reached "
                f"({type(error).__name__}: {error}); start redis-server (or valkey-server) "
                "there or fix url"
            ) from error
        super().attach(host)
        self._client = client
        self._regions = regions

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            client.connection_pool.disconnect()

    @property
    def raw_client(self) -> redis.Redis:
        """The ``redis.Redis`` client this backend uses (for tools, benchmarks, tests)."""
        client, _ = self._ready([])
        return client

    def key_of(self, key: bytes, tenant: str | None = None) -> bytes:
        """The Redis key ``tenant``'s page is stored under (prefix, hex key, order tag)."""
        _, regions = self._ready([])
        return self._tenant_prefix(tenant) + object_name(key, regions.order).encode()

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        client, regions = self._ready(keys)
        self._count_exists_query()
        if not keys:
            return 0
        found = self._stored(client, self._names(keys, regions, current_tenant()))
        return 0 if found is None else first_gap(found)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        client, regions = self._ready(keys, host_pages)
        if not keys:
            return 0
        began = time.perf_counter()
        names = self._names(keys, regions, current_tenant())
        pages = np.asarray(host_pages).tolist()
        num_read = 0
        for part in self._parts(len(keys), regions):
            part_names = names[part.start : part.stop]
            values = self._call(len(part), partial(client.mget, part_names))
            if values is None or len(values) != len(part):
                break
            good = self._land(client, regions, part, names, keys, pages, values)
            num_read += good
            if good < len(part):
                break
        self._count_read(num_read, regions.page_bytes, began)
        return num_read

    def clear(self) -> None:
        """Remove every page key under this backend's prefix (any instance's, any
        tenant's), nothing else."""
        client, _ = self._ready([])
        escaped = _glob_escape(self._prefix)
        self._call(1, partial(_unlink_matching, client, escaped + _PAGE_PATTERN))
        self._call(1, partial(_unlink_matching, client, escaped + b"t" + _HEX32 + b":"
                              + _PAGE_PATTERN))
        with self._lock:
            self._pages.clear()

    def tenant_usage(self) -> dict[str | None, int]:
        """Bytes per tenant of the pages this instance wrote (module docstring)."""
        with self._lock:
            return self._pages.usage()

    def purge_tenant(self, tenant: str | None) -> int:
        """Delete every page of ``tenant`` under the prefix (any instance's); how many.
        StorageError when the server fails it (some may be gone already)."""
        client, _ = self._ready([])
        # A tenant's nested namespaces' names extend its prefix (``tenant_key_prefix``):
        # "*" takes them too. The default tenant has none, and its prefix starts every
        # other tenant's: only its own pages match.
        nested = b"" if tenant is None else b"*"
        pattern = _glob_escape(self._tenant_prefix(tenant)) + nested + _PAGE_PATTERN
        try:
            removed = _unlink_matching(client, pattern)
        except (redis.RedisError, OSError) as error:
            raise StorageError(f"redis storage: purging a tenant failed: "
                               f"{type(error).__name__}: {error}") from error
        with self._lock:
            self._pages.forget_tenant(tenant)
        return removed

    # ------------------------------------------------------ put steps (set)
    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> _RedisPut:
        client, regions = self._ready(keys, host_pages)
        tenant = current_tenant()
        return _RedisPut(
            keys, np.asarray(host_pages).tolist(), regions.page_bytes, client, regions,
            self._names(keys, regions, tenant), tenant,
        )

    def _lookup(self, batch: _RedisPut) -> list[bool] | None:
        return self._stored(batch.client, batch.names)

    def _put(self, batch: _RedisPut, todo: list[int], stored: list[bool]) -> int:
        num_written = 0
        regions, keys, pages, names = batch.regions, batch.keys, batch.pages, batch.names
        pool = batch.client.connection_pool
        object_bytes = regions.page_bytes + regions.header_bytes
        todo = todo[: self._make_tenant_room(batch, len(todo), object_bytes)]
        px_ms = self._tenant_ttl_ms(batch.tenant)
        for part in self._parts(len(todo), regions):
            chosen = todo[part.start : part.stop]
            # Sealed pages: their ciphertext, in one staging buffer for the part.
            staging = regions.staging_for(len(chosen))
            commands = []
            for j, i in enumerate(chosen):
                framed = regions.frame(pages[i], keys[i], regions.page_slice(staging, j))
                if framed is None:  # no key for the tenant: stored up to here
                    self._fail(FailureReason.NO_KEY)
                    chosen = chosen[:j]
                    break
                payload, header = framed
                commands.append(
                    set_command(names[i], [*payload, header], nx=True, px_ms=px_ms)
                )
            if not commands:
                break
            # Redis answers each SET on its own; a refused one comes back as its error.
            results = self._call(len(chosen), partial(pipelined, pool, commands))
            if results is None:
                break
            failed = False
            for i, result in zip(chosen, results, strict=True):
                if isinstance(result, redis.RedisError):
                    if not failed:
                        self._fail(_reason(result))
                    failed = True
                    continue
                stored[i] = True
                if result is not None:  # None: another instance stored it since our EXISTS
                    num_written += 1
                    with self._lock:
                        self._pages.add(names[i].decode(), batch.tenant, object_bytes)
            if failed or len(chosen) < part.stop - part.start:
                break
        return num_written

    # ------------------------------------------------------------ internals
    def _ready(
        self, keys: Sequence[bytes], host_pages: PageIds | None = None
    ) -> tuple[redis.Redis, PageRegions]:
        self._check_open(keys, host_pages)
        if self._client is None or self._regions is None:
            raise self._not_attached()
        return self._client, self._regions

    def _tenant_prefix(self, tenant: str | None) -> bytes:
        """What ``tenant``'s page names start with (module docstring)."""
        if tenant is None:
            return self._prefix
        return self._prefix + tenant_key_prefix(tenant).encode()

    def _names(
        self, keys: Sequence[bytes], regions: PageRegions, tenant: str | None
    ) -> list[bytes]:
        prefix, order = self._tenant_prefix(tenant), regions.order
        return [prefix + object_name(key, order).encode() for key in keys]

    def _tenant_ttl_ms(self, tenant: str | None) -> int | None:
        ttl = None if self.tenant_quotas is None else self.tenant_quotas.l3_ttl_s(tenant)
        return self._ttl_ms if ttl is None else max(1, round(ttl * 1000))

    def _make_tenant_room(self, batch: _RedisPut, count: int, object_bytes: int) -> int:
        """How many of ``count`` new pages of the batch's tenant fit in its quota, after
        deleting its oldest pages this instance wrote (none of the batch) to make room."""
        limit = None if self.tenant_quotas is None else self.tenant_quotas.l3_bytes(batch.tenant)
        if limit is None or count == 0:
            return count
        keep = {name.decode() for name in batch.names}
        with self._lock:
            victims, fits = self._pages.evict_for(batch.tenant, count, object_bytes, limit, keep)
        if victims:
            self._fail(FailureReason.EVICTED_TENANT_QUOTA, len(victims))
            self._call(len(victims), partial(batch.client.unlink, *victims))
        if fits < count:
            self._fail(FailureReason.TENANT_QUOTA_FULL)
        return fits

    def _call(self, pages: int, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when the server failed it (counted against ``pages``)."""
        try:
            return fn()
        except (redis.RedisError, OSError) as error:
            reason = _reason(error)
            logger.debug("redis call failed (%s): %s: %s", reason, type(error).__name__, error)
            self._fail(reason, pages)
            return None

    def _drop(self, keys: Sequence[bytes]) -> None:
        client, regions = self._ready(keys)
        for name in self._names(keys, regions, current_tenant()):
            self._delete(client, name)
            with self._lock:
                self._pages.remove(name.decode())

    @staticmethod
    def _delete(client: redis.Redis, name: bytes) -> None:
        """Drop a damaged page so the next backup stores it again (best effort: the miss
        is counted already, and a page left behind is only found bad again)."""
        try:
            client.delete(name)
        except (redis.RedisError, OSError) as error:
            logger.warning("redis: removing bad page %r failed: %s", name, error)

    def _stored(self, client: redis.Redis, names: list[bytes]) -> list[bool] | None:
        """Which of ``names`` exist (one pipelined EXISTS each), or None (counted)."""
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        found = self._call(len(names), pipe.execute)
        if found is None or len(found) != len(names):
            return None
        return [bool(count) for count in found]

    def _parts(self, count: int, regions: PageRegions) -> Iterator[range]:
        """Consecutive ranges of at most ``max_batch_bytes`` of pages (at least one page each)."""
        object_bytes = regions.page_bytes + regions.header_bytes
        per_part = max(1, self.settings.max_batch_bytes // object_bytes)
        for start in range(0, count, per_part):
            yield range(start, min(start + per_part, count))

    def _land(
        self, client: redis.Redis, regions: PageRegions, part: range, names: list[bytes],
        keys: Sequence[bytes], pages: list[int], values: list[Any],
    ) -> int:
        """Verify and copy ``values`` (MGET's answer for ``part``) into their host pages.

        Returns how many leading pages landed; the first bad one is counted and,
        when damaged (not merely missing), deleted.
        """
        page_bytes = regions.page_bytes
        for j, i in enumerate(part):
            value = values[j]
            if value is None:  # never stored, expired, evicted, or not a string value
                self._fail(FailureReason.MISSING)
                with self._lock:
                    self._pages.remove(names[i].decode())
                return j
            data = memoryview(value)
            payload, header = data[:page_bytes], data[page_bytes:]
            fault = length_fault(len(data), page_bytes + regions.header_bytes)
            if fault is None:
                fault = regions.check_header(header, keys[i])
            if fault is None:
                fault = regions.land(header, pages[i], payload, self.settings.verify_checksum)
            if fault is not None:
                self._fail(fault)
                self._delete(client, names[i])
                with self._lock:
                    self._pages.remove(names[i].decode())
                return j
            with self._lock:
                self._pages.touch(names[i].decode())
        return len(part)


def _reason(error: BaseException) -> FailureReason:
    """The stats reason for a failed Redis command."""
    if isinstance(error, redis.TimeoutError):
        return FailureReason.TIMEOUT
    if isinstance(error, (redis.ConnectionError, OSError)):
        return FailureReason.UNREACHABLE
    if isinstance(error, redis.exceptions.OutOfMemoryError) or str(error).startswith("OOM"):
        return FailureReason.NO_SPACE  # maxmemory reached under a policy that does not evict
    if isinstance(error, redis.exceptions.ReadOnlyError):
        return FailureReason.READ_ONLY  # a replica
    return FailureReason.IO_ERROR


_HEX32 = b"[0-9a-f]" * 32
_PAGE_PATTERN = _HEX32 + b".[lt]m"  # frame.object_name in a SCAN MATCH pattern


def _unlink_matching(client: redis.Redis, pattern: bytes) -> int:
    """Delete every key matching ``pattern`` (SCAN, then UNLINK in chunks); how many."""
    removed = 0
    batch: list[bytes] = []
    for name in client.scan_iter(match=pattern, count=_CLEAR_CHUNK):
        batch.append(name)
        if len(batch) >= _CLEAR_CHUNK:
            removed += int(client.unlink(*batch))
            batch.clear()
    if batch:
        removed += int(client.unlink(*batch))
    return removed


def _glob_escape(text: bytes) -> bytes:
    """``text`` as a literal in a SCAN MATCH pattern."""
    special = _GLOB_SPECIAL.encode()
    return b"".join(b"\\" + bytes([c]) if c in special else bytes([c]) for c in text)
