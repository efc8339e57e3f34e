"""The "file" backend: the embedded L3, one file per page in a local directory.

Extra config:
    path             directory (default ``$HICACHE_CACHE_DIR/l3``, else ``~/.cache/hicache/l3``)
    max_bytes        size cap (int or "16GB"; default 16 GB); pages are evicted, whole
                     files, to stay under it: least recently used first, those of the core
                     set last (``core_fraction``). When the file system fills up
                     before the cap is reached (ENOSPC), pages are evicted the same way to
                     make room for the rest of the batch and the write is retried once.
    min_free_bytes   free space the store leaves on its file system (default: 5% of the
                     file system, at least 1 GiB, at most 10 GiB; 0: none): before a page
                     is written, least recently used pages are evicted while it would leave
                     less, and a page that cannot be written without taking the reserve is
                     not written (a miss later, never an error). So a disk that other
                     programs fill takes the cache's pages back, and the default cap never
                     fills a small disk.
    fsync            fsync each page and its directory before it becomes visible (default false:
                     a crash may lose recent pages, never expose a torn one)
    direct_writes    write each page's payload with O_DIRECT, past the page cache, where the
                     host pool's page regions are block aligned: true, false, or "auto"
                     (default: when the model's forward runs on this machine's CPU cores,
                     ``forward_runs_on_cpu``, and pages are at least 256 KiB). The file
                     is the same either way
                     (``direct_io``: why, what it costs, and the fallback)
    direct_reads     read each page's payload with O_DIRECT, past the page cache: true,
                     false, or "auto" (default: where payloads are written directly)
    verify_checksum  hash every page read against its header (default true; sealed
                     pages are authenticated instead, ``storage.sealing``)
    core_fraction    share of ``max_bytes`` in the loop-resistant core set (default 0.75;
                     0: plain LRU). See ``eviction_order``: a cyclic reuse larger than the
                     cap keeps hitting on the set's pages instead of missing on every page.
                     A core page's file carries ``CORE_MODE_BIT``, so every instance
                     sharing the directory, and a restart, adopts the set with the pages.

Layout on disk: ``<path>/<first two hex digits>/<key hex>.<order tag>``, each file
the payload followed by its ``frame`` header (a trailer, not a prefix: with the
payload at a page-aligned file offset the kernel copies it into the host pool
several times faster than from offset 48, as measured by ``hicache bench
storage`` on an ext4 file system). A page is written to a temporary
name in the same directory and renamed over its final name (``os.replace`` is
atomic), so a reader sees a whole page or none. A temporary's name carries its
writer's host and process id; at start-up the temporaries of writers that are
gone (or of any writer, once old) are removed. Reads and writes go straight
between the file and the host page's memory with ``readv``/``writev``
(``PageRegions``); payloads are written and read past the page cache where the host
pool's regions allow it (``direct_io``).

Sealed pages (``storage.sealing``) use the sealer's threads (``seal_workers``): a batch's
pages are written a few side by side, each by one thread that seals it in pieces of
``SEAL_WRITE_PIECE`` into a small buffer and writes each piece while it is still in
cache (``SealStream``), and a batch's reads run a few pages side by side, each opened by decrypting
straight from its mapped file into the host page (``mapped``: one pass over the bytes
where reading then decrypting in place makes two); a file that cannot be mapped is read
and opened in place. A page read beside the first failure of a batch is counted too
when its object was bad (it was dropped), not when it was only missing. The plain path
stays serial: it is the baseline sealing is measured against.

Several instances may share a directory (pages one writes, the others hit).
Recency is kept in each file's modification time, which a write sets and a
read refreshes with a strictly increasing stamp (file systems keep nanoseconds
but often advance their clock only every few milliseconds), so a new instance
adopts what is on disk in its LRU order: the order survives restarts. The cap is
the directory's, whichever instances write to it: the directory's ``ledger`` counts
its page bytes (every instance adds what it writes and takes off what it removes),
and an instance evicts while the ledger (or what it knows of itself) is over the
cap. It evicts from its own index, in its eviction order: what it wrote, found
on use, or found by its last scan of the directory, which adopts every instance's
pages in their LRU order (modification times). It scans again when the directory is
over the cap and the other instances have written ``RESYNC_FRACTION`` of the cap
since its last scan, or its index has nothing left to evict; so eviction follows
the directory's LRU order, not an instance's, and a scan (one ``stat`` per file,
under the ledger's lock) is paid at most once per that much writing by others.
Instances that write disjoint pages (a router keeping conversations apart) so share
one cap, where each capping its own pages would let the directory grow to the sum.

Pins (``pins``): a page with a live pin marker in the directory is never evicted,
by the cap nor by the ENOSPC path, whichever instance pinned it. Eviction meets
a pinned page as the least recently used and sets it aside (``_held``: still
counted in the size, no longer a candidate); held pages go back into the LRU
order, as its oldest, once their pin is found expired or removed (checked again
at the earliest expiry, or every ``HELD_RECHECK_S`` for another instance's
unpin). When the pinned pages alone fill the cap, a new page is refused
("pinned_full") rather than evicting a pinned one.

Tenants (``call_tenant.current_tenant()`` of each call): a tenant's pages live in a
directory of its own (``tenant_dirs``), so every instance's scan knows whose each page
is, a lookup only ever finds the calling tenant's pages, and ``purge_tenant`` removes a
tenant's files and those of the namespaces nested in it (``tenancy.names.within_tenant``,
told by their directories' name files), whichever instance wrote them (the directories and
name files stay, so an instance writing for the tenant meanwhile leaves pages a scan
still knows). With
``--tenant-quotas``
(``set_tenant_quotas``):
- ``l3=``: a page written for a tenant over its quota first evicts that tenant's own
  least recently used pages (never another tenant's, never a pinned one nor one of the
  same batch); when they cannot make room the page is refused ("tenant_quota_full").
  Each instance enforces it on the pages it knows of (written, found by a scan or on
  use): between an instance's scans, the pages other instances wrote for the tenant
  since are not counted.
- ``l3_ttl=``: a page not used (written or read) for that long is a miss ("expired")
  and removed, pinned or not, when met by a lookup, read or write, by the scan at
  attach, or by the tenant's next backup (which checks its least recently used pages).
``tenant_usage`` reports the bytes per tenant of the pages this instance knows of.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_IMODE, S_ISREG, S_IXUSR
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.direct_io import AUTO_MIN_PAGE_BYTES, DirectIO
from hicache.storage.backends.file.direct_io import usable as direct_io_usable
from hicache.storage.backends.file.eviction_order import Changes, EvictionOrder
from hicache.storage.backends.file.ledger import DirectoryLedger
from hicache.storage.backends.file.mapped import mapped
from hicache.storage.backends.file.pins import PinMarkers, check_expiry
from hicache.storage.backends.file.settings import FileSettings, default_min_free
from hicache.storage.backends.file.tenant_dirs import ensure_tenant_dir, tenant_dirs, tenant_root
from hicache.storage.backends.file.vectored import read_all, write_all
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError
from hicache.storage.call_tenant import current_tenant
from hicache.storage.failure_reasons import CountedReason, FailureReason
from hicache.storage.frame import Fault, object_name
from hicache.storage.options import read_settings
from hicache.storage.page_files import (
    TEMP_SUFFIX,
    create_file,
    holds_our_page,
    is_page_name,
    is_stale_temp,
    page_path,
    temp_name,
    unlink_quietly,
)
from hicache.storage.page_regions import PageRegions
from hicache.storage.tenant_pages import TenantPages
from hicache.tenancy.names import within_tenant

if TYPE_CHECKING:  # imports cryptography: only a sealing store loads it
    from hicache.storage.sealing import Sealer

logger = logging.getLogger(__name__)

# Most of a tenant's oldest pages one backup checks against the tenant's TTL.
EXPIRE_SWEEP_PAGES = 64
# How often held (pinned) pages are checked again for an unpin by another instance
# sharing the directory, while the cap needs room.
HELD_RECHECK_S = 1.0
# Bytes of a sealed page sealed at a time while it is written: a piece stays in the
# writing core's cache until it is written. Measured on 8 MiB pages, two threads, this
# project's CPU machine: 512 KiB 5.4-5.6 GB/s, 256 KiB 4.7-5.2, 1 MiB 5.4-5.7, a whole
# page sealed ahead into staging then written 2.7-3.5 (plain writes 4.3-4.5 serial).
SEAL_WRITE_PIECE = 512 * 1024
_GCM_SLACK = 16
# Share of the cap other instances write to a shared directory before an instance over
# the cap scans the directory again (module docstring).
RESYNC_FRACTION = 0.02
# The mode bit of a page file in the core set (``eviction_order``): the owner's execute
# bit, which exposes nothing to others and means nothing for a data file. Kept in the
# file so that every instance sharing the directory, and a restart, sees the core set.
CORE_MODE_BIT = S_IXUSR


@dataclass(frozen=True)
class _Opened:
    """What opening a sealed page from its mapped file found (None: it authenticated)."""

    fault: Fault | None


class FileBackend(StorageBackend):
    """See the module docstring."""

    name = "file"
    supports_pins = True
    supports_sealing = True

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        settings = read_settings(FileSettings, self.extra_config, "file storage")
        self.root = settings.path
        self._root_text = str(self.root)  # paths are built as text: pathlib costs per page
        self.max_bytes = settings.max_bytes
        self._min_free_setting = settings.min_free_bytes
        # Resolved at attach (the default depends on the file system's size).
        self.min_free_bytes = settings.min_free_bytes or 0
        self._reserve_warned = False
        self.fsync = settings.fsync
        self.direct_writes = settings.direct_writes
        self.direct_reads = settings.direct_reads
        # Set at attach when this host pool's plain pages are written or read directly.
        self.direct: DirectIO | None = None
        self.verify_checksum = settings.verify_checksum
        # name -> file bytes, in eviction order (loop-resistant: ``eviction_order``).
        # Guarded by self._lock.
        self._core_bytes = int(settings.core_fraction * self.max_bytes)
        self._order = EvictionOrder(self._core_bytes)
        self._total_bytes = 0
        self._regions: PageRegions | None = None
        self._last_stamp_ns = 0
        self._pins = PinMarkers(self.root)
        # Pinned pages eviction met: name -> (file bytes, pin expiry). Counted in
        # _total_bytes, never evicted. Guarded by self._lock.
        self._held: dict[str, tuple[int, float]] = {}
        self._held_recheck_at = 0.0
        # Every page of _order and _held by tenant (for quotas, usage, purge). Guarded
        # by self._lock.
        self._pages = TenantPages()
        self._named_tenants: set[str] = set()  # tenant directories known to exist
        self._ledger = DirectoryLedger(self.root)
        # The ledger's written count at this instance's last scan, and the bytes this
        # instance wrote since: the rest were written by others. Guarded by self._lock.
        self._synced_written = 0
        self._own_written = 0
        # Bytes being written by this instance's threads, per tenant and in all (room is
        # made for them before they are written). Guarded by self._lock.
        self._writing: dict[str | None, int] = {}
        self._writing_total = 0
        # The ledger could not be written at the last scan: cap what this instance knows.
        self._ledger_broken = False

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        regions = PageRegions(host, self.sealer)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._open_ledger()
            self._pins.sweep()
            with self._lock:
                self._rescan_locked()
            self.min_free_bytes = self._resolve_min_free()
        except OSError as error:
            self._ledger.close()
            raise StorageUnavailableError(
                f"file storage: cannot use directory {self.root}: {error}"
            ) from error
        super().attach(host)
        self._regions = regions
        self.direct = self._direct_io(regions)
        with self._lock:
            self._evict_locked(0)
        self._keep_free(0, frozenset())  # the disk may have filled while it was down

    def close(self) -> None:
        self._closed = True
        self._ledger.close()

    def _direct_io(self, regions: PageRegions) -> DirectIO | None:
        """What moves plain pages' payloads past the page cache, when they may be."""
        writes = self.direct_writes
        if writes is None:  # auto
            writes = self.forward_on_cpu and regions.page_bytes >= AUTO_MIN_PAGE_BYTES
            if not self.forward_on_cpu:
                logger.info("file storage: pages written through the page cache (the "
                            "forward does not run on this machine's CPU)")
            elif not writes:
                logger.info("file storage: pages written through the page cache (pages "
                            "of %d bytes, under %d)", regions.page_bytes, AUTO_MIN_PAGE_BYTES)
        reads = writes if self.direct_reads is None else self.direct_reads  # auto: alike
        if not (writes or reads):
            return None
        reason = "sealed pages are written in pieces" if regions.sealer is not None else (
            direct_io_usable(regions)
        )
        if reason is not None:
            logger.info("file storage: pages written and read through the page cache: %s",
                        reason)
            return None
        logger.info("file storage: page payloads %s directly (O_DIRECT) in %s",
                    "written and read" if writes and reads else "written" if writes else "read",
                    self._root_text)
        return DirectIO(self._root_text, writes=writes, reads=reads)

    def _resolve_min_free(self) -> int:
        """The free space to leave: the setting, else ``default_min_free`` of the file
        system (0 where it cannot be measured)."""
        if self._min_free_setting is not None:
            return self._min_free_setting
        try:
            stats = os.statvfs(self._root_text)
        except OSError:
            return 0
        return default_min_free(stats.f_blocks * stats.f_frsize)

    def _free_bytes(self) -> int | None:
        """Bytes an unprivileged writer may still use on the store's file system; None
        when it cannot be measured."""
        try:
            stats = os.statvfs(self._root_text)
        except OSError:
            return None
        return stats.f_bavail * stats.f_frsize

    def _keep_free(self, incoming_bytes: int, keep: frozenset[str]) -> bool:
        """Evict least recently used pages (none of ``keep``) until ``incoming_bytes`` more
        (and what this instance's threads are writing) leave ``min_free_bytes`` free on
        the file system; whether they do. One ``statvfs`` when they do already."""
        reserve = self.min_free_bytes
        if reserve <= 0:
            return True
        free = self._free_bytes()
        if free is None:
            return True
        incoming_bytes += self._writing_total
        short = reserve + incoming_bytes - free
        if short <= 0:
            return True
        if not self._reserve_warned:
            self._reserve_warned = True
            logger.warning(
                "file storage: %s has %d bytes free, under the %d the store leaves free "
                "(min_free_bytes); it evicts its least recently used pages to keep them",
                self._root_text, free, reserve,
            )
        self._evict_for_space(short, keep)
        free = self._free_bytes()
        return free is None or free - incoming_bytes >= reserve

    def _open_ledger(self) -> None:
        """Open the directory's ledger; without one (a directory this instance may read but
        not write, a ledger that is not a regular file) the cap holds for this instance's
        pages only, as the warning says."""
        try:
            self._ledger.open()
        except OSError as error:
            self._ledger_broken = True
            logger.warning(
                "file storage: cannot open the ledger %s (%s); the cap holds for this "
                "instance's pages only", self._ledger.path, error,
            )

    @property
    def total_bytes(self) -> int:
        """Bytes of the pages this instance knows of (headers included)."""
        with self._lock:
            return self._total_bytes

    @property
    def directory_bytes(self) -> int | None:
        """Bytes of the directory's page files by its ledger (every instance's; None
        when the ledger cannot be read)."""
        counts = self._ledger.read()
        return None if counts is None else counts.total

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        regions = self._ready(keys)
        self._count_exists_query()
        tenant = current_tenant()
        for i, key in enumerate(keys):
            name = object_name(key, regions.order)
            if not self._known(name, tenant) or self._expired(name, tenant):
                return i
        return len(keys)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        regions = self._ready(keys, host_pages)
        began = time.perf_counter()
        num_read = 0
        tenant = current_tenant()
        items = list(zip(keys, np.asarray(host_pages).tolist(), strict=True))
        if regions.sealer is None:
            for key, page in items:
                fault = self._read_page(regions, key, page, tenant)
                if fault is not None:
                    self._fail(fault)
                    break
                num_read += 1
        else:
            # Sealed pages open on the sealer's threads, a few at a time in order; a page
            # read beside the first failure is counted too when its object was bad (it
            # was dropped), not when it was only missing.
            faults = regions.sealer.workers.ordered(
                lambda item: self._read_page(regions, item[0], item[1], tenant),
                items, stop=lambda fault: fault is not None,
            )
            num_read = next((i for i, fault in enumerate(faults) if fault is not None), len(faults))
            for index, fault in enumerate(faults[num_read:]):
                if fault is not None and (index == 0 or isinstance(fault, Fault)):
                    self._fail(fault)
        self._count_read(num_read, regions.page_bytes, began)
        return num_read

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        regions = self._ready(keys, host_pages)
        began = time.perf_counter()
        names = [object_name(key, regions.order) for key in keys]
        pages = np.asarray(host_pages).tolist()
        tenant = current_tenant()
        self._expire_oldest(tenant)
        # The batch's own pages stay: the answer is a prefix of stored pages.
        keep = frozenset(names)
        # Pages already stored are skipped, decided up front so that only the others are
        # framed (sealed, for a sealing store).
        todo = [
            index for index, name in enumerate(names)
            if not self._known(name, tenant, on_disk=True) or self._expired(name, tenant)
        ]
        file_bytes = regions.header_bytes + regions.page_bytes
        room = _OneRound()  # one eviction round per batch when the file system is full
        # Modification times in the batch's order, whichever thread writes a page first:
        # the LRU order a scan rebuilds is the one a serial batch would leave.
        with self._lock:
            stamps = {index: self._next_stamp_locked() for index in todo}

        def store(index: int) -> FailureReason | None:
            fill = self._filler(regions, keys[index], pages[index])
            stamp = stamps[index]
            reason = self._write_page(names[index], fill, file_bytes, tenant, keep, stamp)
            if reason is FailureReason.NO_SPACE and room.claim():
                needed_bytes = (len(keys) - index) * file_bytes
                if self._evict_for_space(needed_bytes, keep=keep):
                    reason = self._write_page(names[index], fill, file_bytes, tenant, keep,
                                              stamp)
            return reason

        results: list[FailureReason | None] = []
        if regions.sealer is None:
            # The plain path stays serial: it is the baseline sealing is measured against.
            for index in todo:
                results.append(store(index))
                if results[-1] is not None:
                    break
        else:
            # Sealed pages are sealed and written a few side by side, each by one thread.
            results = regions.sealer.workers.ordered(
                store, todo, stop=lambda reason: reason is not None
            )
            # Pages finished in any order: the batch's order is their recency, oldest first.
            with self._lock:
                for index, reason in zip(todo, results, strict=False):
                    if reason is None and names[index] in self._order:
                        self._order.refresh(names[index])
                        self._pages.touch(names[index])
        outcome = dict(zip(todo, results, strict=False))
        num_stored = num_skipped = 0
        for index in range(len(names)):
            if index not in outcome:
                if index in todo:
                    break  # not tried: a page before it failed
                num_skipped += 1
            elif (reason := outcome[index]) is not None:
                self._fail(reason)
                break
            num_stored += 1
        num_written = sum(1 for reason in results if reason is None)
        self._count_write(num_written, num_skipped, regions.page_bytes, began)
        return num_stored

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> int:
        """Pin ``keys``' pages until ``until_unix_s`` (unix seconds) for every instance on
        the directory; a page not stored yet is pinned once written. Returns how many
        leading keys are pinned (a marker that cannot be written stops there, counted)."""
        regions = self._ready(keys)
        until = check_expiry(until_unix_s)
        if until <= time.time():  # already over: nothing to keep
            return len(keys)
        for index, key in enumerate(keys):
            try:
                self._pins.pin(object_name(key, regions.order), until)
            except OSError:
                self._fail(FailureReason.IO_ERROR)
                return index
        return len(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys``' pins (whoever set them): their pages are evictable again, as
        the least recently used. Keys without a pin are ignored. Returns len(keys)."""
        regions = self._ready(keys)
        for key in keys:
            name = object_name(key, regions.order)
            self._pins.unpin(name)
            with self._lock:
                self._release_locked(name)
        return len(keys)

    def clear(self) -> None:
        """Remove every page file in the directory (any instance's) and stale temporaries;
        a file with a page's name but not our header is left alone (``holds_our_page``)."""
        self._ready([])
        with self._lock:
            for _, name, _, tenant, _ in self._scan():
                path = self._path(name, tenant)
                if holds_our_page(path, name):
                    self._remove_file(path)
            self._order.clear()
            self._held.clear()
            self._pages.clear()
            self._total_bytes = 0
            # Pins name pages of the store: with the pages gone they name nothing.
            for name in self._pin_names():
                self._pins.unpin(name)

    def tenant_usage(self) -> dict[str | None, int]:
        """Bytes per tenant of the pages this instance knows of (headers included)."""
        with self._lock:
            return self._pages.usage()

    def purge_tenant(self, tenant: str | None) -> int:
        """Remove every page file of ``tenant`` and of the namespaces nested in it
        (``within_tenant``: a salt under it, an extra key inside its salt; the name files
        of their directories say whose they are) in the directory, whichever instance
        wrote it; returns how many. Pins are left (they expire; a pin names no tenant)."""
        self._ready([])
        removed = 0
        with self._lock:
            for _, name, _, owner, _ in self._scan(
                only=lambda named: within_tenant(named, tenant)
            ):
                path = self._path(name, owner)
                if holds_our_page(path, name):
                    self._remove_file(path)
                    removed += 1
            for owner in [named for named in self._pages.usage() if within_tenant(named, tenant)]:
                for name in self._pages.names(owner):
                    self._forget_locked(name)
        return removed

    def check_integrity(self) -> None:
        with self._lock:
            held = sum(size for size, _ in self._held.values())
            self._order.check()
            assert self._total_bytes == self._order.total_bytes + held, "size accounting drifted"
            assert self._total_bytes == sum(self._pages.usage().values()), "tenant bytes drifted"
            assert len(self._pages) == len(self._order) + len(self._held), "tenant index drifted"
            assert not set(self._order) & set(self._held), "a page both held and evictable"
            assert self._total_bytes <= self.max_bytes or not self._order, "over the cap"

    # ------------------------------------------------------------ internals
    def _drop(self, keys: Sequence[bytes]) -> None:
        regions = self._ready(keys)
        tenant = current_tenant()
        for key in keys:
            name = object_name(key, regions.order)
            with self._lock:
                path = self._recorded_path(name, tenant)
                self._forget_locked(name)
                self._remove_file(path)

    def _ready(self, keys: Sequence[bytes], host_pages: PageIds | None = None) -> PageRegions:
        self._check_open(keys, host_pages)
        if self._regions is None:
            raise self._not_attached()
        return self._regions

    def _dir(self, name: str, tenant: str | None) -> str:
        return f"{tenant_root(self._root_text, tenant)}/{name[:2]}"

    def _path(self, name: str, tenant: str | None) -> str:
        return page_path(tenant_root(self._root_text, tenant), name)

    def _recorded_path(self, name: str, tenant: str | None) -> str:
        """The file of ``name``: where its recorded tenant keeps it, else ``tenant``'s."""
        if name in self._pages:
            tenant = self._pages.tenant_of(name)
        return self._path(name, tenant)

    def _add_locked(
        self, name: str, tenant: str | None, size: int, stamp: int, core: bool | None = None
    ) -> None:
        """A page written (``core`` None: it joins the core set by the eviction order's
        rules) or found on disk (``core``: what its file says): the most recently used,
        of its tenant too."""
        self._total_bytes += size
        self._pages.add(name, tenant, size)
        if core is None:
            self._mark_core_locked(self._order.write(name, size, stamp))
        else:
            self._order.adopt(name, size, stamp, core)

    def _mark_core_locked(self, changes: Changes) -> None:
        """Record core set changes in the pages' files (``CORE_MODE_BIT``), so that the
        other instances sharing the directory and a restart find them (best effort: a
        file that cannot be changed keeps its old mark until it is next used)."""
        for names, joined in ((changes.joined, True), (changes.left, False)):
            for name in names:
                path = self._recorded_path(name, None)
                with contextlib.suppress(OSError):
                    mode = S_IMODE(os.stat(path).st_mode)
                    os.chmod(path, mode | CORE_MODE_BIT if joined else mode & ~CORE_MODE_BIT)

    def _ttl_s(self, tenant: str | None) -> float | None:
        quotas = self.tenant_quotas
        return None if quotas is None else quotas.l3_ttl_s(tenant)

    def _past_ttl(self, tenant: str | None, mtime_ns: int, now: float) -> bool:
        ttl = self._ttl_s(tenant)
        return ttl is not None and mtime_ns < (now - ttl) * 1e9

    def _expired(self, name: str, tenant: str | None) -> bool:
        """Is ``tenant``'s page unused for longer than its TTL? Then it is removed, and
        counted (one stat, only for a tenant with a TTL)."""
        if self._ttl_s(tenant) is None:
            return False
        path = self._path(name, tenant)
        try:
            mtime_ns = os.stat(path).st_mtime_ns
        except OSError:
            return False  # gone meanwhile: the read or write finds out
        if not self._past_ttl(tenant, mtime_ns, time.time()):
            return False
        with self._lock:
            self._forget_locked(name)
            self._remove_file(path)
            self._stats.fail(FailureReason.EXPIRED)
        return True

    def _expire_oldest(self, tenant: str | None) -> None:
        """Remove ``tenant``'s least recently used pages while they are past its TTL (at
        each backup: pages nobody asks for again expire too). Stops at the first page in
        its TTL, so a backup pays one stat when nothing expired."""
        if self._ttl_s(tenant) is None:
            return
        with self._lock:
            oldest = self._pages.least_recent(tenant, EXPIRE_SWEEP_PAGES)
        for name in oldest:
            if not self._expired(name, tenant):  # pinned pages expire too
                return

    def _known(self, name: str, tenant: str | None, on_disk: bool = False) -> bool:
        """Is ``tenant``'s page stored? Adopts a file another instance wrote (one stat).

        A page in the index is taken as stored unless ``on_disk`` asks to check
        the file (another instance sharing the directory may have evicted it):
        a lookup that is wrong is a miss at read time, but a write skipped
        wrongly would leave the page missing for good.
        """
        with self._lock:
            # Recorded as another tenant's (never, with salted keys): not this tenant's.
            ours = name not in self._pages or self._pages.tenant_of(name) == tenant
            if ours and (name in self._order or name in self._held) and not on_disk:
                return True
            try:
                info = os.stat(self._path(name, tenant))
            except OSError:
                if ours:
                    self._forget_locked(name)
                return False
            if not S_ISREG(info.st_mode):  # a FIFO, device or directory is no page
                if ours:
                    self._forget_locked(name)
                return False
            size = info.st_size
            if name not in self._pages:
                core = bool(info.st_mode & CORE_MODE_BIT)
                self._add_locked(name, tenant, size, info.st_mtime_ns, core)
                self._evict_locked(0)
            return name in self._pages and self._pages.tenant_of(name) == tenant

    def _forget_locked(self, name: str, evicted: bool = False) -> None:
        """Forget ``name``; ``evicted``: to make room (its last use is kept, for the core
        set's rules)."""
        size = self._order.pop(name, evicted)
        if size is not None:
            self._total_bytes -= size
        held = self._held.pop(name, None)
        if held is not None:
            self._total_bytes -= held[0]
        self._pages.remove(name)

    def _read_page(
        self, regions: PageRegions, key: bytes, page: int, tenant: str | None
    ) -> CountedReason | None:
        """Read one of ``tenant``'s pages into host page ``page``; the failure reason, or None."""
        name = object_name(key, regions.order)
        path = self._path(name, tenant)
        expected = regions.header_bytes + regions.page_bytes
        header = bytearray(regions.header_bytes)
        opened: _Opened | None = None
        got = 0
        # O_NONBLOCK: opening a FIFO (or a device) put in place of a page file must not
        # wait for a writer; it changes nothing for a regular file, the only kind read.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(name)
            return FailureReason.MISSING
        except OSError:
            return FailureReason.IO_ERROR
        try:
            info = os.fstat(fd)
            if not S_ISREG(info.st_mode):
                with self._lock:
                    self._forget_locked(name)
                return FailureReason.NOT_REGULAR_FILE
            size = info.st_size
            if self._past_ttl(tenant, info.st_mtime_ns, time.time()):
                with self._lock:
                    self._forget_locked(name)
                    self._remove_file(path)
                return FailureReason.EXPIRED
            opened = (
                self._open_mapped(regions, fd, key, page)
                if regions.sealer is not None and size == expected
                else None
            )
            if opened is None:
                direct = self.direct if size == expected else None  # else: a fault to find
                got = (
                    read_all(fd, [*regions.views(page), memoryview(header)]) if direct is None
                    else direct.read(fd, regions.views(page), memoryview(header))
                )
        except OSError:
            return FailureReason.IO_ERROR
        finally:
            os.close(fd)
        fault: Fault | None
        if opened is not None:
            fault = opened.fault
        elif got < expected:
            fault = Fault.SHORT_READ
        else:
            fault = regions.check_header(header, key)
            if fault is None and size != expected:
                fault = Fault.WRONG_LENGTH  # trailing bytes: not a file we wrote
            if fault is None:
                fault = regions.check_landed(header, page, self.verify_checksum)
        with self._lock:
            if fault is not None:
                # A bad object is dropped so that a later set() can store it again.
                self._forget_locked(name)
                self._remove_file(path)
                return fault
            stamp = self._next_stamp_locked()
            if name not in self._order and name not in self._held:
                # Written by another instance since we last looked.
                core = bool(info.st_mode & CORE_MODE_BIT)
                self._add_locked(name, tenant, size, info.st_mtime_ns, core)
                self._evict_locked(0)
            if name in self._order:
                self._mark_core_locked(self._order.use(name, stamp))
                self._pages.touch(name)
        # Evicted or replaced meanwhile: the read itself was complete.
        with contextlib.suppress(OSError):
            os.utime(path, ns=(stamp, stamp))  # the LRU order a restarted instance rebuilds
        return None

    def _open_mapped(
        self, regions: PageRegions, fd: int, key: bytes, page: int
    ) -> _Opened | None:
        """Open the sealed page in ``fd`` (a whole file's size) into host page ``page``
        by decrypting it straight from the mapped file (``mapped``); None when it cannot
        be mapped here (then it is read). Raises ``OSError`` when reading it fails."""
        page_bytes = regions.page_bytes
        with mapped(fd, page_bytes + regions.header_bytes) as data:
            if data is None:
                return None
            header = bytes(data[page_bytes:])
            fault = regions.check_header(header, key)
            if fault is None:
                payload = data[:page_bytes]
                try:
                    fault = regions.land(header, page, payload, self.verify_checksum)
                finally:
                    payload.release()  # the mapping closes only once no view is left
            return _Opened(fault)

    def _filler(
        self, regions: PageRegions, key: bytes, page: int
    ) -> Callable[[int], None] | None:
        """What writes host page ``page``'s object for ``key`` into an open file: its
        frame (``PageRegions.frame``), or, sealing, the page sealed piece by piece as it
        is written (``_write_sealed``: each call seals afresh, with a new nonce). None
        when the call's tenant has no key to seal with."""
        sealer = regions.sealer
        if sealer is None:
            framed = regions.frame(page, key)
            assert framed is not None, "a plain frame is always written"
            payload, header = framed
            direct = self.direct
            if direct is not None and direct.writes:
                return lambda fd: direct.write(fd, payload, header)
            return lambda fd: write_all(fd, [*payload, header])
        if not sealer.can_seal():
            return None
        return lambda fd: _write_sealed(fd, sealer, regions, key, page)

    def _write_page(
        self, name: str, fill: Callable[[int], None] | None, file_bytes: int,
        tenant: str | None, keep: frozenset[str], stamp: int | None = None,
    ) -> FailureReason | None:
        """Store the object ``fill`` writes (``file_bytes`` long; None: its tenant has no
        key) as ``tenant``'s ``name`` (evicting none of ``keep`` for the tenant's quota);
        the failure reason, or None."""
        if file_bytes > self.max_bytes:
            return FailureReason.OVER_CAPACITY
        if tenant is not None and tenant not in self._named_tenants:
            try:
                ensure_tenant_dir(self._root_text, tenant)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    return FailureReason.NO_SPACE
                return FailureReason.IO_ERROR
            self._named_tenants.add(tenant)
        # Sealed for the call's tenant (``current_tenant``), the one named here.
        if fill is None:
            return FailureReason.NO_KEY
        if not self._keep_free(file_bytes, keep):
            return FailureReason.NO_SPACE
        with self._lock:
            # Pages of the tenant other threads are writing count against its quota as if
            # written already (a batch's pages are written side by side when sealed).
            pending = self._writing.get(tenant, 0)
            if not self._make_tenant_room_locked(tenant, file_bytes + pending, keep):
                return FailureReason.TENANT_QUOTA_FULL
            # And against the cap, unless only they do not fit: then they evict this page's
            # elders once written, as a serial batch would.
            if not self._evict_locked(file_bytes + self._writing_total) and not (
                self._evict_locked(file_bytes)
            ):
                return FailureReason.PINNED_FULL  # only pinned pages are left to evict
            if stamp is None:
                stamp = self._next_stamp_locked()
            self._writing[tenant] = pending + file_bytes
            self._writing_total += file_bytes
        try:
            reason = self._write_reserved(name, fill, file_bytes, tenant, stamp)
        except BaseException:
            with self._lock:
                self._unreserve_locked(tenant, file_bytes)
            raise
        if reason is not None:  # written, it was unreserved as it was recorded
            with self._lock:
                self._unreserve_locked(tenant, file_bytes)
        return reason

    def _unreserve_locked(self, tenant: str | None, file_bytes: int) -> None:
        """A page ``_write_page`` made room for is written (and recorded) or failed."""
        self._writing_total -= file_bytes
        left = self._writing[tenant] - file_bytes
        if left:
            self._writing[tenant] = left
        else:
            del self._writing[tenant]

    def _write_reserved(
        self, name: str, fill: Callable[[int], None], file_bytes: int, tenant: str | None,
        stamp: int,
    ) -> FailureReason | None:
        """``_write_page`` once room is made: the file written, renamed into place and
        accounted; the failure reason, or None."""
        path = self._path(name, tenant)
        temp = f"{self._dir(name, tenant)}/{temp_name(name, os.getpid(), threading.get_ident())}"
        try:
            self._write_file(temp, fill)
            os.utime(temp, ns=(stamp, stamp))
            with self._ledger.change() as account:
                replaced = _file_bytes(path)  # another writer's copy of the page: counted once
                os.replace(temp, path)
                account(file_bytes - replaced, file_bytes)
            if self.fsync:
                _fsync_directory(self._dir(name, tenant))
        except OSError as error:
            unlink_quietly(temp)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                return FailureReason.NO_SPACE
            return FailureReason.IO_ERROR
        with self._lock:
            self._unreserve_locked(tenant, file_bytes)  # counted as recorded from here
            self._own_written += file_bytes
            self._forget_locked(name)  # a concurrent writer of the same page won the race
            self._add_locked(name, tenant, file_bytes, stamp)
            self._evict_locked(0)
        return None

    def _make_tenant_room_locked(
        self, tenant: str | None, incoming_bytes: int, keep: frozenset[str]
    ) -> bool:
        """Evict ``tenant``'s own least recently used pages (not pinned ones, nor
        ``keep``) until ``incoming_bytes`` more fit in its L3 quota; whether they do."""
        quotas = self.tenant_quotas
        limit = None if quotas is None else quotas.l3_bytes(tenant)
        if limit is None:
            return True
        if self._pages.bytes_of(tenant) + incoming_bytes <= limit:
            return True
        now = time.time()
        for name, size in self._pages.oldest(tenant):
            if self._pages.bytes_of(tenant) + incoming_bytes <= limit:
                break
            if name in keep or name in self._held:
                continue
            until = self._pins.expiry(name, now)
            if until is not None:  # set aside, as the cap's eviction does
                self._order.pop(name)
                self._held[name] = (size, until)
                self._held_recheck_at = min(self._held_recheck_at, until)
                continue
            path = self._path(name, tenant)
            self._forget_locked(name, evicted=True)
            self._remove_file(path)
            self._stats.fail(FailureReason.EVICTED_TENANT_QUOTA)
        return self._pages.bytes_of(tenant) + incoming_bytes <= limit

    def _write_file(self, path: str, fill: Callable[[int], None]) -> None:
        fd = create_file(path, getattr(os, "O_CLOEXEC", 0))
        try:
            fill(fd)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _next_stamp_locked(self) -> int:
        """A modification time (ns) later than any this instance gave before."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _evict_locked(self, incoming_bytes: int) -> bool:
        """Drop least recently used pages until ``incoming_bytes`` more fit under the cap,
        both in what this instance knows of and in the directory (its ledger); whether
        they fit. Pinned pages are set aside instead (module docstring), so it may fall
        short; so may it when the directory's pages beyond this instance's index are
        all pinned."""
        now = time.time()
        directory = self._directory_bytes_locked(incoming_bytes)
        rescanned = False
        while True:
            over = max(self._total_bytes, directory) + incoming_bytes > self.max_bytes
            if over and self._held and now >= self._held_recheck_at:  # when room is needed
                self._recheck_held_locked(now)
            while self._order and max(self._total_bytes, directory) + incoming_bytes > (
                self.max_bytes
            ):
                oldest = self._order.pop_oldest()
                assert oldest is not None
                name, size, used = oldest
                until = self._pins.expiry(name, now)
                if until is not None:
                    self._held[name] = (size, until)
                    self._held_recheck_at = min(self._held_recheck_at, until)
                    continue
                self._order.remember(name, used)
                self._total_bytes -= size
                self._stats.fail(FailureReason.EVICTED)
                tenant, _ = self._pages.remove(name) or (None, 0)
                directory -= self._remove_file(self._path(name, tenant))
            if directory + incoming_bytes <= self.max_bytes or rescanned:
                break
            # This instance's pages are gone and the directory is still over: the rest
            # are other instances' pages it has not seen, or the ledger drifted. Once.
            rescanned = True
            if self._try_rescan_locked():
                directory = self._total_bytes
        return max(self._total_bytes, directory) + incoming_bytes <= self.max_bytes

    def _directory_bytes_locked(self, incoming_bytes: int) -> int:
        """The directory's page bytes (its ledger; this instance's own when it cannot be
        read), after a scan when it is over the cap and others wrote enough since the
        last one that this instance's index and LRU order are stale."""
        if self._ledger_broken:
            return self._total_bytes
        counts = self._ledger.read()
        if counts is None:  # damaged: a scan rewrites it (and says whether it could)
            self._try_rescan_locked()
            return self._total_bytes
        if counts.total + incoming_bytes > self.max_bytes:
            by_others = counts.written - self._synced_written - self._own_written
            resync_bytes = max(1, int(self.max_bytes * RESYNC_FRACTION))
            if by_others >= resync_bytes and self._try_rescan_locked():
                return self._total_bytes
        return counts.total

    def _try_rescan_locked(self) -> bool:
        """``_rescan_locked``; False (nothing changed) when the directory cannot be
        listed right now: the caller goes on with what it knows."""
        try:
            self._rescan_locked()
        except OSError:
            return False
        return True

    def _rescan_locked(self) -> None:
        """Rebuild the index from a scan of the directory, every instance's pages in LRU
        order (modification times), under the ledger's lock, and set the ledger to what
        it found. Pages past their tenant's TTL are removed on the way. Raises
        ``OSError`` when the directory cannot be listed."""

        def scan() -> int:
            now = time.time()
            order = EvictionOrder(self._core_bytes)
            held: dict[str, tuple[int, float]] = {}
            pages = TenantPages()
            total = 0
            found = sorted(self._scan(), key=lambda f: (f[0], f[1]))
            for mtime_ns, name, size, tenant, core in found:
                if self._past_ttl(tenant, mtime_ns, now):
                    unlink_quietly(self._path(name, tenant))  # uncounted: not in the total
                    self._stats.fail(FailureReason.EXPIRED)
                    continue
                if name in self._held:
                    held[name] = (size, self._held[name][1])
                else:
                    order.adopt(name, size, mtime_ns, core)
                pages.add(name, tenant, size)
                total += size
            order.inherit_history(self._order)
            self._order, self._held, self._pages, self._total_bytes = order, held, pages, total
            self._mark_core_locked(order.trim())
            return total

        counts = self._ledger.resync(scan)
        self._synced_written = 0 if counts is None else counts.written
        self._own_written = 0
        if (counts is None) != self._ledger_broken:
            self._ledger_broken = counts is None
            if counts is None:
                logger.warning(
                    "file storage: the ledger %s cannot be written; the cap holds for "
                    "this instance's pages only until the next start", self._ledger.path,
                )

    def _remove_file(self, path: str) -> int:
        """Remove a page file, best effort (``unlink_quietly``); the bytes it removed,
        which it takes off the directory's ledger."""
        with self._ledger.change() as account:
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except OSError:
                return 0
            account(-size, 0)
        return size

    def _recheck_held_locked(self, now: float) -> None:
        """Put held pages whose pin expired or was removed back into the LRU order."""
        next_check = now + HELD_RECHECK_S
        for name in list(self._held):
            until = self._pins.expiry(name, now)
            if until is None:
                self._release_locked(name)
            else:
                self._held[name] = (self._held[name][0], until)
                next_check = min(next_check, until)
        self._held_recheck_at = next_check

    def _release_locked(self, name: str) -> None:
        """A held page is evictable again, as the least recently used."""
        held = self._held.pop(name, None)
        if held is not None:
            self._order.add_oldest(name, held[0])
            self._pages.demote(name)

    def _evict_for_space(self, needed_bytes: int, keep: frozenset[str]) -> int:
        """The file system is full: drop least recently used pages (except ``keep``) until
        ``needed_bytes`` are freed. Returns how many pages were dropped."""
        with self._lock:
            victims: list[str] = []
            freed_bytes = 0
            now = time.time()
            for name, size in self._order.items():  # in eviction order
                if freed_bytes >= needed_bytes:
                    break
                if name not in keep and self._pins.expiry(name, now) is None:
                    victims.append(name)
                    freed_bytes += size
            for name in victims:
                path = self._recorded_path(name, None)
                self._forget_locked(name, evicted=True)
                self._remove_file(path)
            if victims:
                self._stats.fail(FailureReason.EVICTED_NO_SPACE, len(victims))
        return len(victims)

    def _pin_names(self) -> list[str]:
        """The page names of every pin marker, live or not."""
        found: list[str] = []
        root = self._pins.root
        if not root.is_dir():
            return found
        for sub in root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            with os.scandir(sub) as entries:
                for entry in entries:
                    if is_page_name(entry.name):
                        found.append(entry.name)
        return found

    def _scan(
        self, only: Callable[[str | None], bool] | None = None
    ) -> list[tuple[int, str, int, str | None, bool]]:
        """(mtime ns, name, bytes, tenant, in the core set) of every page file (of the
        tenants ``only`` accepts, when given); removes stale temporaries."""
        roots: list[tuple[str | None, Path]] = []
        if only is None or only(None):
            roots.append((None, self.root))
        for named, directory in tenant_dirs(self.root):
            if only is None or only(named):
                roots.append((named, directory))
        found: list[tuple[int, str, int, str | None, bool]] = []
        for tenant, root in roots:
            found.extend(
                (mtime, name, size, tenant, core)
                for mtime, name, size, core in self._scan_dir(root)
            )
        return found

    def _scan_dir(self, root: Path) -> list[tuple[int, str, int, bool]]:
        """(mtime ns, name, bytes, in the core set) of the page files of one tenant's
        directory."""
        found: list[tuple[int, str, int, bool]] = []
        now = time.time()
        for sub in root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            with os.scandir(sub) as entries:
                for entry in entries:
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed meanwhile
                    if entry.name.endswith(TEMP_SUFFIX):
                        if is_stale_temp(entry.name, now - stat.st_mtime):
                            unlink_quietly(entry.path)
                    elif is_page_name(entry.name) and S_ISREG(stat.st_mode):
                        core = bool(stat.st_mode & CORE_MODE_BIT)
                        found.append((stat.st_mtime_ns, entry.name, stat.st_size, core))
        return found



def _write_sealed(fd: int, sealer: Sealer, regions: PageRegions, key: bytes, page: int) -> None:
    """Write host page ``page`` sealed for ``key`` into ``fd``: its payload in pieces of
    ``SEAL_WRITE_PIECE``, each sealed into this thread's small buffer and written while
    still in cache, then the sealed header. Sealing a whole page into a staging buffer
    and writing that moved the page through memory once more (docs/benchmarks.md)."""
    stream = sealer.begin(key, regions.order, regions.page_bytes)
    if stream is None:  # the ring is fixed: the caller checked ``can_seal``
        raise StorageError("sealing key vanished while writing a page")
    # update_into may want a block's slack past the piece.
    buffer = sealer.staging(SEAL_WRITE_PIECE + _GCM_SLACK)
    for fragment in regions.views(page):
        for start in range(0, fragment.nbytes, SEAL_WRITE_PIECE):
            written = stream.update_into(fragment[start : start + SEAL_WRITE_PIECE], buffer)
            write_all(fd, [buffer[:written]])
    write_all(fd, [stream.finish()])


class _OneRound:
    """A flag the first of a batch's threads to ask for claims (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


def _file_bytes(path: str) -> int:
    """The size of the file at ``path``; 0 when there is none."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
