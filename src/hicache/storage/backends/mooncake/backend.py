"""The "mooncake" backend: pages in a Mooncake Store, a memory pool spread over many machines.

Every instance that attaches contributes ``global_segment_size`` bytes of its
memory to the pool; a ``mooncake_master`` keeps the index of which object lives
in which segment. Pages one instance stores, every instance using the same
master reads (over TCP, or RDMA with ``protocol: rdma``).

Extra config (each key falls back to an environment variable; the extra config wins):

    master_server_address  host:port of the master (MOONCAKE_MASTER_SERVER_ADDRESS or
                           MOONCAKE_MASTER); required
    metadata_server        where transfer engines find each other: "P2PHANDSHAKE" (the
                           default: no extra server), "http://host:port/metadata", an etcd
                           "host:port" or "etcd://host:port", or "redis://host:port"
                           (MOONCAKE_METADATA_SERVER or MOONCAKE_TE_META_DATA_SERVER)
    protocol               "tcp" (default) or "rdma" (MOONCAKE_PROTOCOL)
    local_hostname         the address other instances reach this one at; default
                           127.0.0.1, which only works when every instance and the master
                           share one machine (MOONCAKE_LOCAL_HOSTNAME)
    global_segment_size    bytes this instance lends to the pool, e.g. "4GiB" (the default);
                           0 lends nothing (MOONCAKE_GLOBAL_SEGMENT_SIZE)
    local_buffer_size      the client's bounce buffer for copies it cannot do in place,
                           default "16MiB" (MOONCAKE_LOCAL_BUFFER_SIZE)
    device_name            RDMA device(s), e.g. "mlx5_0,mlx5_1"; empty lets Mooncake pick
                           (MOONCAKE_DEVICE_NAME or MOONCAKE_DEVICE)
    verify_checksum        hash every page read against its header (default true)

Object format and zero copy. Each page is one object named like the file
backend's files (``frame.object_name``: the namespaced key in hex and the
payload-order tag) holding the payload followed by the ``frame`` header
(``payload || header``, as in the file backend's files), so a reader checks
key, length and checksum exactly as the file backend does. The header goes
last because Mooncake copies an object fastest when the payload starts where
the object does: with the 48-byte header in front, reads of layer_first pages
(64 regions of 128 KiB) ran at a third of the speed. The payload never
passes through a bounce buffer: the whole host pool is registered with the
Mooncake client at attach, and every batch (at most ``MAX_BATCH_PAGES``) moves with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` whose
per-object buffer list is ``[page region, ..., header slot]``; the page
regions are the page's own memory in the pool (``PageRegions``: one region for
page_first layouts, one per layer and K/V for layer_first). The 48-byte
headers live in a small staging area, registered too, with one slot per page
of a batch. We chose this over a separate header object (two objects per
page: twice the index entries and lookups, and a reader could pair a header
with a payload from another write) and over ``put_parts`` (it takes Python
bytes and copies them into the client's local buffer first).

Sealed pages (``--l3-encryption-keys``, ``storage.sealing``): a page's ciphertext
cannot be put from the page itself, so it is sealed into a second registered
staging area and put from there, a batch in parts of about ``SEAL_PART_BYTES``, the
helper thread sealing up to two parts ahead into a ring of three while Mooncake puts
the oldest; where this instance lends no memory (every page crosses the transport to
another client's segment) in parts of ``SEAL_PART_BYTES_REMOTE``, one ahead in a ring
of two. Headers are 64 bytes. Reads land the ciphertext in the host page as plain
reads do, and the helper thread opens (decrypts in place) what it would otherwise
hash; a page opened beside the first failure is counted too when its object was bad
(it was removed). Either way a part's pages are sealed or opened side by side on
``SealWorkers.beside_copy()`` threads: Mooncake's copy of the neighbouring part keeps a
core busy, and on two cores a second sealer beside it only slowed both.

Checksums cost a pass over every page, which the backend keeps in the CPU's
cache (``cache_steps``): a batch moves in steps of about half the
last-level cache, one Mooncake call each; a helper thread hashes the next
step to put (pulling it into the cache, where Mooncake's copy then reads
it) or verifies the step just read (which the copy has just written into
the cache) while Mooncake copies another, and each page is handed to
Mooncake in pieces of ``COPY_PIECE_BYTES`` so its memcpy uses cacheable
stores. Hashing then reads from cache rather than making a second pass over
DRAM; both threads release the GIL. That hides the hash where a spare core
is free. Where none is (two busy vCPUs) the hash adds its time to the
copy's: about 0.6x of the raw client's throughput there (docs/benchmarks.md).

Failures. A page that is missing, fails its header or checksum, or has the
wrong size is a miss counted under its reason (``frame.Fault`` values,
"missing", ...), and a bad object is removed (forced past Mooncake's read
lease) so a later backup can store it again. A dead master is the case that
needs care: the client library retries it inside each call, blocking the
caller for seconds. So each client has a watcher thread that checks every
``WATCH_INTERVAL_S`` that the master accepts TCP connections (refused at once
when it is down); while it does not, and from the moment a call reports an
RPC failure, calls fail at once as "unreachable" without entering the library.
Those failures feed the storage controller's circuit breaker. When the master
is back the watcher notices, calls go through again, and the client registers
its memory segment with the new master on its own (a restarted master starts
with an empty store). A call made in the short window between a master's
death and the watcher's next check may still block once. A master that cannot
be reached at attach is a ``StorageUnavailableError``, raised at once.
Closing a client (or exiting) while its master is down takes the library
several seconds of retries.

One client per process. A Mooncake client owns a memory segment, a transfer
engine and its listeners, and takes a second or two to close; backends with the
same connection settings in one process share one client (reference
counted), so two caches in one process lend their memory once. Each backend
registers its own host pool with the shared client and unregisters it at
close.

Note: Mooncake's transfer engine listens for its peers (handshake and data
ports) on all interfaces whatever ``local_hostname`` says; ``local_hostname``
only decides the address it advertises.

Tenants (``call_tenant.current_tenant()`` of each call). The default tenant's objects
are named as above; tenant ``t``'s are ``t<32 hex>:<frame.object_name>``, the hex a
hash of the tenant (``file.tenant_dirs.tenant_dir_name``), so a lookup only ever finds
the calling tenant's pages; a namespace nested in ``t`` (``t/salt``) adds its own
``t<32 hex>:`` after ``t``'s (``tenant_key_prefix``), so ``purge_tenant`` removes a
tenant's objects and its nested namespaces' with one ``remove_by_regex``, whichever
instance wrote them. With ``--tenant-quotas``:
- ``l3=``: enforced on the objects *this instance* wrote (their bytes per tenant, least
  recently written or read first): a backup that would take the tenant past its quota
  first removes the tenant's oldest such objects, never another tenant's nor one of the
  same batch; the pages that still do not fit are refused ("tenant_quota_full"). It
  cannot count other instances' writes nor see the master's own evictions (a page found
  missing on read is forgotten): several instances bound a tenant by the sum of theirs.
- ``l3_ttl=``: enforced on the objects *this instance* wrote, from their write: one
  found past it on a lookup or a read is a miss from there on and removed, and at each
  backup of the tenant every one past it is removed. The master has no expiry per object
  (its lease TTL only guards reads in flight), so another instance's objects go by their
  writer's TTL, or the master's eviction under memory pressure.
``tenant_usage`` reports the per-instance counts.
A namespace nested in a tenant (``tenancy.names.within_tenant``: a salt under it, an extra
key inside its salt) is named under the tenant's prefix, so ``purge_tenant(t)`` removes it
with ``t``'s objects (and a tenant whose name merely starts like ``t``'s keeps its own).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.tenant_dirs import NESTED_PREFIX_REGEX, tenant_key_prefix
from hicache.storage.backends.mooncake.cache_steps import (
    COPY_PIECE_BYTES,
    cache_step_bytes,
    copy_pieces,
    last_level_cache_bytes,
)
from hicache.storage.backends.mooncake.client import (
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    MooncakeClient,
    acquire_client,
    failure_reason,
    release_client,
)
from hicache.storage.backends.mooncake.settings import MooncakeSettings
from hicache.storage.base import MAX_BATCH_PAGES, LookupPutBackend, PutBatch, StorageError
from hicache.storage.call_tenant import call_tenant, current_tenant
from hicache.storage.failure_reasons import CountedReason, FailureReason
from hicache.storage.frame import (
    SEALED_HEADER_BYTES,
    Fault,
    length_fault,
    object_name,
    pack_header_into,
)
from hicache.storage.options import read_settings
from hicache.storage.page_regions import PageRegions
from hicache.storage.seal_workers import SealWorkers
from hicache.storage.tenant_pages import TenantPages

logger = logging.getLogger(__name__)

# Batches are moved in chunks (cache steps) of about this many bytes, at least
# one page each, hashing one chunk on a helper thread while Mooncake moves
# another (see the module docstring and cache_steps).
PIPELINE_CHUNK_BYTES = cache_step_bytes(last_level_cache_bytes())
# Each page is handed to Mooncake cut into pieces of at most this many bytes.
PAGE_PIECE_BYTES = COPY_PIECE_BYTES
# Header staging slots: one batch each. The controller runs at most one get or
# set at a time; the spare slots serve other callers (a benchmark) without waiting.
_STAGING_SLOTS = 4
# Bytes of one header slot: room for a sealed header (a plain one uses the first 48).
_SLOT_BYTES = SEALED_HEADER_BYTES
# Sealed pages' ciphertext: a sealed batch is put in parts of about this many bytes (at
# least one page each), from a registered ring of _SEAL_RING parts per staging slot,
# where pages may land in this instance's own segment (it lends the pool memory): those
# move by memcpy at memory speed, and a part small enough to stay in the CPU's cache
# until Mooncake copies it measured best.
SEAL_PART_BYTES = 8 << 20
# Parts in the ring: the sealer runs up to two parts ahead of Mooncake's copy, so that a
# part that seals slowly does not stall the copy (two halves measured 0.79x of the plain
# copy's throughput, a ring of three 0.90x, in a model of the pipeline on two cores).
_SEAL_RING = 3
# Parts where this instance lends no memory (global_segment_size 0): every page then
# crosses the transfer engine's transport to another client's segment, where each call's
# fixed cost outweighs the cache (8 MiB parts measured 0.64x of the plain put over TCP,
# 32 MiB 0.75x, 64 MiB 0.80-0.83x; docs/benchmarks.md), in a ring of two.
SEAL_PART_BYTES_REMOTE = 64 << 20
_SEAL_RING_REMOTE = 2
# Every object name this backend writes (what clear() removes): a tenant's prefix
# (none for the default tenant), hex key, order tag.
_PAGE = r"[0-9a-f]{32}\.(lm|tm)$"
_NAME_PATTERN = r"^(t[0-9a-f]{32}:)?" + _PAGE


@dataclass
class _MooncakePut(PutBatch):
    client: MooncakeClient
    regions: PageRegions
    names: list[str]
    tenant: str | None


class MooncakeBackend(LookupPutBackend[_MooncakePut]):
    """See the module docstring."""

    name = "mooncake"
    supports_sealing = True

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.settings = read_settings(MooncakeSettings, self.extra_config, "mooncake storage")
        self.verify_checksum = self.settings.verify_checksum
        self._client: MooncakeClient | None = None
        self._regions: PageRegions | None = None
        self._pool_address = 0
        # [slot, page, header bytes]: where batch headers are packed and read.
        self._staging = np.zeros((_STAGING_SLOTS, MAX_BATCH_PAGES, _SLOT_BYTES), dtype=np.uint8)
        self._staging_view = self._staging.reshape(-1).data
        self._staging_address = int(self._staging.ctypes.data)
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(_STAGING_SLOTS):
            self._free_slots.put(slot)
        self._executor: ThreadPoolExecutor | None = None
        # Sealing: [slot, pages * page bytes] of ciphertext, made at attach.
        self._sealed: np.ndarray | None = None
        self._sealed_pages = 0
        self._seal_ring = _SEAL_RING
        # What l3_ttl= is counted with (monotonic seconds; tests set their own).
        self.clock: Callable[[], float] = time.monotonic
        # The objects this instance wrote, by tenant (quotas, usage, TTL). Guarded by self._lock.
        self._pages = TenantPages()

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self._check_attachable(self._client is not None)
        regions = PageRegions(host, self.sealer)
        if self.sealer is not None:
            remote = self.settings.global_segment_size == 0
            part_bytes = SEAL_PART_BYTES_REMOTE if remote else SEAL_PART_BYTES
            self._seal_ring = _SEAL_RING_REMOTE if remote else _SEAL_RING
            # Pages per part: about part_bytes, and at least one page for each thread
            # that seals beside Mooncake's copy (_put_sealed).
            self._sealed_pages = min(
                MAX_BATCH_PAGES,
                max(1, self.sealer.workers.beside_copy(), part_bytes // regions.page_bytes),
            )
            # Zeroed on demand by the OS: a slot's ring takes memory once a batch uses it.
            self._sealed = np.zeros(
                (_STAGING_SLOTS, self._seal_ring * self._sealed_pages * regions.page_bytes),
                dtype=np.uint8,
            )
        client = acquire_client(self.settings)
        registered: list[int] = []
        try:
            for address, nbytes in self._registrations(regions):
                client.register(address, nbytes)
                registered.append(address)
        except BaseException:
            for address in registered:
                client.unregister(address)
            release_client(client)
            raise
        super().attach(host)
        self._client = client
        self._regions = regions
        self._pool_address = regions.base_address

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        client, self._client = self._client, None
        if client is not None:
            client.unregister(self._pool_address)
            client.unregister(self._staging_address)
            if self._sealed is not None:
                client.unregister(int(self._sealed.ctypes.data))
            release_client(client)

    def _registrations(self, regions: PageRegions) -> list[tuple[int, int]]:
        """(address, bytes) of the memory Mooncake moves pages from and into."""
        memory = [
            (regions.base_address, regions.pool_bytes),
            (self._staging_address, self._staging.nbytes),
        ]
        if self._sealed is not None:
            memory.append((int(self._sealed.ctypes.data), self._sealed.nbytes))
        return memory

    @property
    def reachable(self) -> bool:
        """False while the master is known unreachable (L3 calls then fail at once)."""
        client, _ = self._ready([])
        return client.usable()

    @property
    def raw_store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (shared; for tools, benchmarks, tests)."""
        client, _ = self._ready([])
        return client.store

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        client, regions = self._ready(keys)
        self._count_exists_query()
        if not keys:
            return 0
        names = self._names(keys, regions, current_tenant())
        names = names[: self._unexpired(client, current_tenant(), names)]
        if not names:
            return 0
        codes = self._call(client, len(names), lambda store: store.batch_is_exist(names))
        if codes is None:
            return 0
        for i, code in enumerate(codes):
            if code != 1:
                if code < 0:
                    self._fail(failure_reason(code))
                return i
        return len(names)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        client, regions = self._ready(keys, host_pages)
        if not keys:
            return 0
        began = time.perf_counter()
        names = self._names(keys, regions, current_tenant())
        live = self._unexpired(client, current_tenant(), names)
        if live < len(names):  # a page past its tenant's TTL: a miss from there on
            keys, host_pages, names = keys[:live], host_pages[:live], names[:live]
            if not live:
                return 0
        pages = np.asarray(host_pages).tolist()
        expected = regions.page_bytes + regions.header_bytes
        num_read = 0
        with self._staging_slot() as slot:
            base = self._slot_offset(slot)

            # Hashing (or opening sealed pages) here, not left to the cache's load: in
            # cache steps, in pieces.
            hashing = regions.sealer is not None or (
                self.verify_checksum and not regions.digests.defer_checks
            )

            def read(part: range) -> list[int] | None:
                buffers, sizes = self._buffer_lists(
                    regions, pages[part.start : part.stop], base, part, hashing
                )
                part_names = names[part.start : part.stop]
                return self._call(
                    client, len(part),
                    lambda store: store.batch_get_into_multi_buffers(part_names, buffers, sizes),
                )

            tenant = current_tenant()  # the helper thread opens sealed pages for it

            def verify(part: range, codes: list[int]) -> int:
                """How many leading pages of ``part`` are good (the first bad one is counted)."""
                with call_tenant(tenant):
                    return verify_for_tenant(part, codes)

            def verify_for_tenant(part: range, codes: list[int]) -> int:
                if regions.sealer is not None:
                    return open_sealed(part, codes, regions.sealer.workers)
                for i, code in zip(part, codes, strict=True):
                    reason = self._check_read(
                        client, regions, names[i], keys[i], pages[i], code, expected,
                        base + i * _SLOT_BYTES,
                    )
                    if reason is not None:
                        self._fail(reason)
                        with self._lock:
                            self._pages.remove(names[i])
                        return i - part.start
                    with self._lock:
                        self._pages.touch(names[i])
                return len(part)

            def open_sealed(part: range, codes: list[int], workers: SealWorkers) -> int:
                """verify_for_tenant for sealed pages: opened side by side on the sealer's
                threads; a page opened beside the first failure is counted too when its
                object was bad (it was removed), not when it was only missing."""

                def check(item: tuple[int, int]) -> CountedReason | None:
                    i, code = item
                    return self._check_read(
                        client, regions, names[i], keys[i], pages[i], code, expected,
                        base + i * _SLOT_BYTES,
                    )

                reasons = workers.ordered(
                    check, list(zip(part, codes, strict=True)),
                    stop=lambda reason: reason is not None, threads=workers.beside_copy(),
                )
                good = next(
                    (k for k, reason in enumerate(reasons) if reason is not None), len(reasons)
                )
                for k, (i, reason) in enumerate(zip(part, reasons, strict=False)):
                    with self._lock:
                        if reason is None:
                            self._pages.touch(names[i])
                        else:
                            self._pages.remove(names[i])
                    if reason is not None and (k == good or isinstance(reason, Fault)):
                        self._fail(reason)
                return good

            parts = self._parts(
                len(keys), regions.page_bytes, hashing,
                1 if regions.sealer is None else regions.sealer.workers.beside_copy(),
            )
            num_read = self._read_ahead(parts, read, verify)
        self._count_read(num_read, regions.page_bytes, began)
        return num_read

    def clear(self) -> None:
        """Remove every page object from the store (any instance's), whatever its lease."""
        client, _ = self._ready([])
        if not client.usable():
            self._fail(FailureReason.UNREACHABLE)
            return
        try:
            removed = int(client.store.remove_by_regex(_NAME_PATTERN, True))
        except Exception as error:  # the binding raised: count it, never propagate
            logger.warning("mooncake clear failed: %s: %s", type(error).__name__, error)
            self._fail(FailureReason.IO_ERROR)
            return
        if removed < 0:
            client.saw_codes([removed])
            self._fail(failure_reason(removed))
            return
        with self._lock:
            self._pages.clear()

    def tenant_usage(self) -> dict[str | None, int]:
        """Bytes per tenant of the objects this instance wrote (module docstring)."""
        with self._lock:
            return self._pages.usage()

    def purge_tenant(self, tenant: str | None) -> int:
        """Remove every object of ``tenant`` (any instance's, whatever its lease); how
        many. StorageError when the master cannot be asked or refuses."""
        client, _ = self._ready([])
        if not client.usable():
            raise StorageError("mooncake storage: the master is unreachable; nothing purged")
        nested = "" if tenant is None else NESTED_PREFIX_REGEX  # and its nested namespaces'
        pattern = "^" + re.escape(_tenant_prefix(tenant)) + nested + _PAGE
        try:
            removed = int(client.store.remove_by_regex(pattern, True))
        except Exception as error:  # the binding raised
            raise StorageError(f"mooncake storage: purging a tenant failed: "
                               f"{type(error).__name__}: {error}") from error
        if removed < 0:
            client.saw_codes([removed])
            raise StorageError(f"mooncake storage: purging a tenant failed "
                               f"({failure_reason(removed).value}, code {removed})")
        with self._lock:
            self._pages.forget_tenant(tenant)
        return removed

    # ------------------------------------------------------ put steps (set)
    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> _MooncakePut:
        client, regions = self._ready(keys, host_pages)
        tenant = current_tenant()
        self._remove_expired(client, tenant)
        return _MooncakePut(
            keys, np.asarray(host_pages).tolist(), regions.page_bytes, client, regions,
            self._names(keys, regions, tenant), tenant,
        )

    def _lookup(self, batch: _MooncakePut) -> list[bool] | None:
        names = batch.names
        present = self._call(
            batch.client, len(names), lambda store: store.batch_is_exist(names)
        )
        return None if present is None else [code == 1 for code in present]

    def _put(self, batch: _MooncakePut, todo: list[int], stored: list[bool]) -> int:
        client, regions, keys, pages, names = (
            batch.client, batch.regions, batch.keys, batch.pages, batch.names
        )
        codes: dict[int, int] = {}
        object_bytes = regions.page_bytes + regions.header_bytes
        todo = todo[: self._make_tenant_room(batch, len(todo), object_bytes)]
        if not todo:
            return 0
        if regions.sealer is not None:
            self._put_sealed(batch, todo, codes)
            return self._settle_put(batch, todo, stored, codes, object_bytes)
        # Pages the cache checksummed while copying them in need no hash here.
        hashing = any(regions.digests.digest(pages[i]) is None for i in todo)
        with self._staging_slot() as slot:
            base = self._slot_offset(slot)

            def pack(part: range) -> None:
                for j in part:
                    i = todo[j]
                    digest = regions.checksum(pages[i])
                    pack_header_into(
                        self._staging_view, base + j * _SLOT_BYTES, keys[i], regions.order,
                        regions.page_bytes, digest,
                    )

            def put(part: range) -> bool:
                chosen = todo[part.start : part.stop]
                buffers, sizes = self._buffer_lists(
                    regions, [pages[i] for i in chosen], base, part, hashing
                )
                chosen_names = [names[i] for i in chosen]
                results = self._call(
                    client, len(chosen),
                    lambda store: store.batch_put_from_multi_buffers(
                        chosen_names, buffers, sizes
                    ),
                )
                for i, code in zip(chosen, results or (), strict=False):
                    codes[i] = code
                return results is not None and all(
                    code in (0, OBJECT_ALREADY_EXISTS) for code in results
                )

            self._write_behind(self._parts(len(todo), regions.page_bytes, hashing), pack, put)
        return self._settle_put(batch, todo, stored, codes, object_bytes)

    def _put_sealed(self, batch: _MooncakePut, todo: list[int], codes: dict[int, int]) -> None:
        """Seal the pages ``todo`` into this slot's ciphertext staging and put them from
        there, recording each page's code in ``codes``: in parts of half the staging
        area, the helper thread sealing part k+1 into one half while part k is put from
        the other (``_write_behind``). Stops after the first part that did not store
        completely. A tenant without a key has nothing put (counted "no_key")."""
        client, regions, keys, pages, names = (
            batch.client, batch.regions, batch.keys, batch.pages, batch.names
        )
        sealer = regions.sealer
        assert self._sealed is not None and sealer is not None
        tenant = current_tenant()  # the helper thread seals for it
        if sealer.ring.write_key(tenant) is None:
            self._fail(FailureReason.NO_KEY)
            return
        page_bytes, header_bytes = regions.page_bytes, regions.header_bytes
        per_part, ring = self._sealed_pages, self._seal_ring
        parts = [
            range(start, min(start + per_part, len(todo)))
            for start in range(0, len(todo), per_part)
        ]
        threads = sealer.workers.beside_copy()
        with self._staging_slot() as slot:
            base = self._slot_offset(slot)
            area = self._sealed[slot]
            area_view, area_address = area.data, int(area.ctypes.data)

            def half(part: range) -> int:
                """Where part ``part``'s ciphertext starts in the area (its place in the ring)."""
                return (part.start // per_part) % ring * per_part * page_bytes

            def seal(j: int, part: range) -> None:
                i = todo[j]
                offset = half(part) + (j - part.start) * page_bytes
                framed = regions.frame(pages[i], keys[i], area_view[offset : offset + page_bytes])
                assert framed is not None, "the tenant's key was checked"
                slot_offset = base + j * _SLOT_BYTES
                self._staging_view[slot_offset : slot_offset + header_bytes] = framed[1]

            def pack(part: range) -> None:
                # The part's pages side by side on the sealer's threads.
                with call_tenant(tenant):
                    sealer.workers.ordered(
                        lambda j: seal(j, part), list(part), stop=lambda _: False,
                        threads=threads,
                    )

            def put(part: range) -> bool:
                chosen = [todo[j] for j in part]
                buffers = [
                    [area_address + half(part) + (j - part.start) * page_bytes,
                     self._staging_address + base + j * _SLOT_BYTES]
                    for j in part
                ]
                results = self._call(
                    client, len(chosen),
                    partial(_put_from, names=[names[i] for i in chosen], buffers=buffers,
                            sizes=[[page_bytes, header_bytes]] * len(chosen)),
                )
                for i, code in zip(chosen, results or (), strict=False):
                    codes[i] = code
                return results is not None and all(
                    code in (0, OBJECT_ALREADY_EXISTS) for code in results
                )

            self._write_behind(parts, pack, put, lookahead=ring - 1)

    def _settle_put(
        self, batch: _MooncakePut, todo: list[int], stored: list[bool], codes: dict[int, int],
        object_bytes: int,
    ) -> int:
        """Mark what the puts' ``codes`` stored (recording the pages written as the batch's
        tenant's, ``object_bytes`` each); count the first page left unstored by its code.
        Returns how many pages were written."""
        names = batch.names
        num_written = 0
        for i, code in codes.items():
            if code == 0:
                num_written += 1
                with self._lock:
                    self._pages.add(names[i], batch.tenant, object_bytes, self.clock())
            if code in (0, OBJECT_ALREADY_EXISTS):  # or another instance stored it meanwhile
                stored[i] = True
        # The first page left unstored is counted by its code (a call that could not be
        # made was counted by _call).
        first_unstored = next((i for i in todo if not stored[i]), None)
        if first_unstored is not None and first_unstored in codes:
            self._fail(failure_reason(codes[first_unstored]))
        return num_written

    # ------------------------------------------------------------ internals
    @staticmethod
    def _names(keys: Sequence[bytes], regions: PageRegions, tenant: str | None) -> list[str]:
        prefix = _tenant_prefix(tenant)
        return [prefix + object_name(key, regions.order) for key in keys]

    def _make_tenant_room(self, batch: _MooncakePut, count: int, object_bytes: int) -> int:
        """How many of ``count`` new pages of the batch's tenant fit in its quota, after
        removing its oldest objects this instance wrote (none of the batch) for room."""
        limit = None if self.tenant_quotas is None else self.tenant_quotas.l3_bytes(batch.tenant)
        if limit is None or count == 0:
            return count
        keep = set(batch.names)
        with self._lock:
            victims, fits = self._pages.evict_for(batch.tenant, count, object_bytes, limit, keep)
        if victims:
            self._fail(FailureReason.EVICTED_TENANT_QUOTA, len(victims))
            if batch.client.usable():
                for name in victims:
                    self._remove(batch.client, name)
        if fits < count:
            self._fail(FailureReason.TENANT_QUOTA_FULL)
        return fits

    def _ready(
        self, keys: Sequence[bytes], host_pages: PageIds | None = None
    ) -> tuple[MooncakeClient, PageRegions]:
        self._check_open(keys, host_pages)
        if self._client is None or self._regions is None:
            raise self._not_attached()
        return self._client, self._regions

    def _call(
        self, client: MooncakeClient, pages: int, fn: Callable[[Any], Sequence[int]]
    ) -> list[int] | None:
        """One batch call; per-key codes, or None when it could not be made (counted)."""
        if not client.usable():
            self._fail(FailureReason.UNREACHABLE, pages)
            return None
        try:
            codes = [int(code) for code in fn(client.store)]
        except Exception as error:  # the binding raised: count it, never propagate
            logger.warning("mooncake call failed: %s: %s", type(error).__name__, error)
            self._fail(FailureReason.IO_ERROR, pages)
            return None
        if len(codes) != pages:
            self._fail(FailureReason.IO_ERROR, pages)
            return None
        client.saw_codes(codes)
        if codes and all(code == RPC_FAIL for code in codes):
            self._fail(FailureReason.UNREACHABLE, pages)
            return None
        return codes

    @contextlib.contextmanager
    def _staging_slot(self) -> Iterator[int]:
        slot = self._free_slots.get()
        try:
            yield slot
        finally:
            self._free_slots.put(slot)

    @staticmethod
    def _slot_offset(slot: int) -> int:
        return slot * MAX_BATCH_PAGES * _SLOT_BYTES

    def _buffer_lists(
        self, regions: PageRegions, pages: list[int], slot_offset: int, part: range,
        hashing: bool,
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Per object: [page regions..., its header slot] addresses and sizes.

        ``part`` gives the header slots: page ``pages[j]`` uses slot ``part[j]``.
        ``hashing``: the pages are hashed here, so they move in pieces that leave them
        in the cache (cache_steps); otherwise in whole regions, as a plain client would.
        """
        header = self._staging_address + slot_offset
        buffers: list[list[int]] = []
        object_sizes = [regions.region_bytes] * regions.num_regions
        for page, slot in zip(pages, part, strict=True):
            if hashing:
                # Pieces, not whole regions: each is one memcpy that leaves its bytes
                # in the cache for the hash (cache_steps).
                pieces, object_sizes = copy_pieces(
                    regions.addresses(page), regions.region_bytes, PAGE_PIECE_BYTES
                )
            else:
                pieces = regions.addresses(page)
            pieces.append(header + slot * _SLOT_BYTES)
            buffers.append(pieces)
        object_sizes = [*object_sizes, regions.header_bytes]
        return buffers, [object_sizes] * len(pages)

    @staticmethod
    def _parts(count: int, page_bytes: int, hashing: bool, min_pages: int = 1) -> list[range]:
        """Split a batch of ``count`` pages into the chunks it is moved in (see _read_ahead):
        one when nothing is hashed here (a chunk would only add a call); chunks of at least
        ``min_pages`` pages where the batch has them (one per sealer thread, to open side
        by side)."""
        if not hashing:
            return [range(count)]
        chunks = max(
            1, min(count // max(1, min_pages), count * page_bytes // PIPELINE_CHUNK_BYTES)
        )
        bounds = [round(k * count / chunks) for k in range(chunks + 1)]
        return [range(bounds[k], bounds[k + 1]) for k in range(chunks)]

    def _hasher(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-mooncake-hash")
            return self._executor

    def _read_ahead(
        self, parts: list[range], read: Callable[[range], list[int] | None],
        verify: Callable[[range, list[int]], int],
    ) -> int:
        """Read the parts in order, verifying part k on the hash thread while part k+1 moves.

        Returns the verified leading pages; stops at the first bad page or failed read.
        """
        if len(parts) == 1:
            codes = read(parts[0])
            return 0 if codes is None else verify(parts[0], codes)
        hasher = self._hasher()
        checked: Future[int] | None = None
        good = 0
        try:
            for part in parts:
                codes = read(part)
                if checked is not None:
                    previous, checked = checked, None
                    ok = previous.result()
                    good += ok
                    if good < part.start:
                        return good
                if codes is None:
                    return good
                checked = hasher.submit(verify, part, codes)
            if checked is not None:
                previous, checked = checked, None
                good += previous.result()
            return good
        finally:
            if checked is not None:  # never leave the hash thread inside our staging slot
                checked.result()

    def _write_behind(
        self, parts: list[range], pack: Callable[[range], None], put: Callable[[range], bool],
        lookahead: int = 1,
    ) -> None:
        """Put the parts in order, packing (hashing, sealing) parts k+1 .. k+``lookahead``
        on the hash thread while part k moves: whatever ``pack`` writes for part k must
        stay untouched by the ``lookahead`` packs after it.

        Stops after the first part that did not store completely.
        """
        if len(parts) == 1:
            pack(parts[0])
            put(parts[0])
            return
        hasher = self._hasher()
        packed: deque[Future[None]] = deque(
            hasher.submit(pack, part) for part in parts[:lookahead]
        )
        try:
            for k, part in enumerate(parts):
                packed.popleft().result()
                if k + lookahead < len(parts):
                    packed.append(hasher.submit(pack, parts[k + lookahead]))
                if not put(part):
                    return
        finally:
            # Never leave the hash thread inside our staging slot: drop the packs not
            # started, wait for the one running.
            for future in packed:
                if not future.cancel():
                    future.result()

    def _check_read(
        self, client: MooncakeClient, regions: PageRegions, name: str, key: bytes, page: int,
        code: int, expected: int, header_offset: int,
    ) -> CountedReason | None:
        """The failure reason for one object of a batch read, or None if it is good."""
        if code < 0:
            reason = failure_reason(code)
            if code in (OBJECT_NOT_FOUND, RPC_FAIL) or reason is FailureReason.UNREACHABLE:
                return reason
            # A size that does not fit our buffers is refused by the library with a
            # generic code; the object's size tells a damaged object from an I/O error.
            size = self._size_of(client, name)
            if size is None:
                return reason
            if size < 0:
                return failure_reason(size)
            fault = length_fault(size, expected)
            if fault is None:
                return reason
        else:
            fault = length_fault(code, expected)
            if fault is None:
                header = self._staging_view[header_offset : header_offset + regions.header_bytes]
                fault = regions.check_read(header, page, key, self.verify_checksum)
            if fault is None:
                return None
        self._remove(client, name)
        return fault

    def _size_of(self, client: MooncakeClient, name: str) -> int | None:
        try:
            return int(client.store.get_size(name))
        except Exception:
            return None

    def _ttl_s(self, tenant: str | None) -> float | None:
        return None if self.tenant_quotas is None else self.tenant_quotas.l3_ttl_s(tenant)

    def _remove_expired(self, client: MooncakeClient, tenant: str | None) -> None:
        """Remove ``tenant``'s objects this instance wrote longer ago than its
        ``l3_ttl=`` (at each backup of the tenant: the master has no expiry of its own)."""
        ttl = self._ttl_s(tenant)
        if ttl is None:
            return
        with self._lock:
            victims = self._pages.expired(tenant, ttl, self.clock())
        if victims and client.usable():
            for name in victims:
                self._remove(client, name)

    def _unexpired(self, client: MooncakeClient, tenant: str | None, names: list[str]) -> int:
        """How many leading ``names`` are within their tenant's ``l3_ttl=`` (as far as this
        instance knows their writes); the first one past it is removed: a miss."""
        ttl = self._ttl_s(tenant)
        if ttl is None:
            return len(names)
        now = self.clock()
        with self._lock:
            stale = next((i for i, name in enumerate(names)
                          if self._pages.is_expired(name, ttl, now)), None)
            if stale is None:
                return len(names)
            self._pages.remove(names[stale])
        if client.usable():
            self._remove(client, names[stale])
        return stale

    def _drop(self, keys: Sequence[bytes]) -> None:
        client, regions = self._ready(keys)
        if client.usable():
            for name in self._names(keys, regions, current_tenant()):
                self._remove(client, name)
                with self._lock:
                    self._pages.remove(name)

    def _remove(self, client: MooncakeClient, name: str) -> None:
        """Drop a bad object, even while leased to readers (it must not be read again)."""
        try:
            code = int(client.store.remove(name, True))
        except Exception as error:
            logger.warning("mooncake: removing bad object %s failed: %s", name, error)
            return
        if code not in (0, OBJECT_NOT_FOUND):
            logger.warning("mooncake: removing bad object %s failed (code %d)", name, code)


def _put_from(
    store: Any, names: list[str], buffers: list[list[int]], sizes: list[list[int]]
) -> Sequence[int]:
    """One multi-buffer put of ``names`` (for ``MooncakeBackend._call``)."""
    codes: Sequence[int] = store.batch_put_from_multi_buffers(names, buffers, sizes)
    return codes


def _tenant_prefix(tenant: str | None) -> str:
    """What ``tenant``'s object names start with (module docstring)."""
    return "" if tenant is None else tenant_key_prefix(tenant)
