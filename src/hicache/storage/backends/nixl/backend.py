"""The "nixl" backend: page files in a directory, moved by NVIDIA NIXL's storage plugins.

Extra config:
    path                 directory of the page files (default ``$HICACHE_CACHE_DIR/l3-nixl``,
                         else ``~/.cache/hicache/l3-nixl``)
    plugin               NIXL plugin: "POSIX" (default), "GDS" or "GDS_MT" (GPUDirect
                         Storage: need CUDA and libcufile, so a GPU machine; not tested
                         here). "OBJ" (S3 objects) is refused: it takes object descriptors,
                         not files, which this backend does not build.
    io_queue             POSIX plugin's kernel queue: "auto" (default, the plugin picks
                         Linux AIO), "aio", "uring" (io_uring) or "posix_aio"
    direct_io            open page files with O_DIRECT, bypassing the page cache (default
                         false). Needs a host pool whose page regions start at 4096-byte
                         aligned addresses and are multiples of 4096 bytes long (checked at
                         attach)
    verify_checksum      hash every page read against its header (default true)
    transfer_timeout_s   deadline of one batch transfer (default 10); a batch past it is
                         cancelled and counts as failed ("timeout")

Layout. Files are named as the file backend names them
(``<path>/<first two hex digits>/<key hex>.<order tag>``) and hold
``payload || trailer``, the trailer beginning with the ``frame`` header. In
buffered mode the trailer is the 48-byte header alone, so such a directory
holds exactly the file backend's files and the two backends read each other's
pages. With ``direct_io`` every I/O must be block aligned, so the trailer is
the header padded with zeros to 4096 bytes; files of one mode are the wrong
length for the other (a miss, counted as "wrong_length", and removed).

Zero copy with registered memory. The host pool is registered with the NIXL
agent once, at attach: every page region (one per page for page_first
layouts, one per layer and K/V for layer_first, ``PageRegions``) is a DRAM
descriptor into it, against a FILE descriptor at the region's offset in the
page's file. The headers cannot live in the pool, so each call borrows a
small registered buffer with one trailer slot per page of the batch
(``trailers``): writes pack the header there before the transfer, reads
land the stored trailer there and check it after. A whole batch, every page's
regions and trailers, is one NIXL transfer request (READ or WRITE), polled to
completion under ``transfer_timeout_s``. Each page file is opened and
registered with the agent for the request that uses it only.

Visibility and failures. Pages are written to temporaries (named as the file
backend names them) and renamed into place after the transfer completed, so
a reader sees a whole page or none. Before a read, every file's size is
checked: a missing file ends the prefix ("missing"), a file of the wrong size
is removed and ends it too. After the read each page's header and checksum
are checked in order (``frame``); the first bad one is removed and ends the
prefix. A transfer NIXL reports failed (an I/O error, a full disk) or that
missed its deadline fails its whole batch ("io_error", "timeout").

There is no size cap and no eviction: the directory grows until ``clear``
(unlike the file backend's LRU ``max_bytes``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from stat import S_ISREG
from typing import Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.nixl.agent import NixlAgent, TransferFailed
from hicache.storage.backends.nixl.settings import DIRECT_ALIGN_BYTES, NixlSettings
from hicache.storage.backends.nixl.trailers import TrailerPool, TrailerSlots
from hicache.storage.base import (
    StorageBackend,
    StorageError,
    StorageUnavailableError,
    first_gap,
)
from hicache.storage.failure_reasons import CountedReason, FailureReason
from hicache.storage.frame import (
    HEADER_BYTES,
    length_fault,
    object_name,
    pack_header_into,
)
from hicache.storage.options import read_settings
from hicache.storage.page_files import (
    TEMP_SUFFIX,
    create_file,
    holds_our_page,
    is_stale_temp,
    page_path,
    temp_name,
    unlink_quietly,
)
from hicache.storage.page_regions import PageRegions

# TransferFailed reasons: the whole batch failed.
_BATCH_FAULTS = (FailureReason.IO_ERROR, FailureReason.TIMEOUT)


class NixlBackend(StorageBackend):
    """See the module docstring."""

    name = "nixl"

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.settings = read_settings(NixlSettings, self.extra_config, "nixl storage")
        self._root_text = str(self.settings.path)
        self._trailer_bytes = self.settings.trailer_bytes
        self._open_flags = self.settings.open_flags
        # Made here, not at attach, so that a plugin that cannot load is a configuration error.
        self._agent = NixlAgent(self.settings.plugin, self.settings.plugin_params)
        self._regions: PageRegions | None = None
        self._trailers: TrailerPool | None = None

    @property
    def raw_agent(self) -> NixlAgent:
        """The NIXL agent (host pool registered after attach): the bench's baseline borrows it."""
        return self._agent

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        regions = PageRegions(host)
        if self.settings.direct_io:
            _check_direct_alignment(regions)
        try:
            self.settings.path.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
        except OSError as error:
            raise StorageUnavailableError(
                f"nixl storage: cannot use directory {self.settings.path}: {error}"
            ) from error
        if self.settings.direct_io:
            self._probe_direct_io()
        self._agent.register_dram(regions.base_address, regions.pool_bytes)
        super().attach(host)
        self._regions = regions
        self._trailers = TrailerPool(self._agent, self._trailer_bytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._trailers is not None:
            self._trailers.close()
        self._agent.close()

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        regions = self._ready(keys)
        self._count_exists_query()
        for i, key in enumerate(keys):
            try:
                if not self._stored(self._path(object_name(key, regions.order))):
                    return i
            except OSError:
                # Not a missing page but a directory that cannot be searched (gone bad,
                # no permission): an outage, which the L3 tier's breaker must hear of.
                self._fail(FailureReason.IO_ERROR)
                return i
        return len(keys)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        regions = self._ready(keys, host_pages)
        began = time.perf_counter()
        pages = np.asarray(host_pages).tolist()
        fds: list[int] = []
        fault: CountedReason | None = None
        num_read = 0
        failed_pages = 1  # a bad or missing file ends the prefix by itself
        try:
            for key in keys:
                fd, fault = self._open_for_read(self._path(object_name(key, regions.order)))
                if fd is None:
                    break
                fds.append(fd)
            if fds:
                num_read, read_fault = self._read_batch(regions, keys, pages, fds)
                if read_fault in _BATCH_FAULTS:
                    failed_pages = len(fds)  # the transfer failed: the whole batch is lost
                if read_fault is not None:
                    fault = read_fault
        finally:
            for fd in fds:
                os.close(fd)
        if fault is not None:
            self._fail(fault, failed_pages)
        self._count_read(num_read, regions.page_bytes, began)
        return num_read

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        regions = self._ready(keys, host_pages)
        began = time.perf_counter()
        paths = [self._path(object_name(key, regions.order)) for key in keys]
        stored = [self._stored_or_not(path) for path in paths]
        todo = [i for i, done in enumerate(stored) if not done]
        num_written = 0
        if todo:
            pages = np.asarray(host_pages).tolist()
            reason = self._write_batch(
                regions, [keys[i] for i in todo], [pages[i] for i in todo],
                [paths[i] for i in todo],
            )
            if reason is None:
                num_written = len(todo)
                for i in todo:
                    stored[i] = True
            else:
                self._fail(reason, len(todo))
        num_stored = first_gap(stored)
        self._count_write(num_written, len(keys) - len(todo), regions.page_bytes, began)
        return num_stored

    def clear(self) -> None:
        """Remove every page file in the directory (any instance's) and stale temporaries.

        A live writer's temporary stays (its rename would fail otherwise), and so does
        anything that is not ours: a page file goes only when it holds our header
        (``holds_our_page``), whatever its name.
        """
        self._ready([])
        for sub in self._fan_out_dirs():
            with os.scandir(sub) as entries:
                for entry in entries:
                    if holds_our_page(entry.path, entry.name):
                        unlink_quietly(entry.path)
        self._remove_stale_temporaries()

    # ------------------------------------------------------------ internals
    def _drop(self, keys: Sequence[bytes]) -> None:
        regions = self._ready(keys)
        for key in keys:
            unlink_quietly(self._path(object_name(key, regions.order)))

    def _ready(self, keys: Sequence[bytes], host_pages: PageIds | None = None) -> PageRegions:
        self._check_open(keys, host_pages)
        if self._regions is None:
            raise self._not_attached()
        return self._regions

    def _path(self, name: str) -> str:
        return page_path(self._root_text, name)

    @property
    def _file_bytes(self) -> int:
        assert self._regions is not None
        return self._regions.page_bytes + self._trailer_bytes

    def _stored(self, path: str) -> bool:
        """Is a page file of the right size there? (OSError: the path cannot be searched.)"""
        try:
            info = os.stat(path)
        except FileNotFoundError:  # the page, or its fan-out directory, is not there yet
            return False
        return S_ISREG(info.st_mode) and info.st_size == self._file_bytes

    def _stored_or_not(self, path: str) -> bool:
        """``_stored``, where an unsearchable path counts as not stored (the write that
        follows fails and is counted)."""
        try:
            return self._stored(path)
        except OSError:
            return False

    def _open_for_read(self, path: str) -> tuple[int | None, CountedReason | None]:
        """An fd of a page file of the right size, or (None, why not)."""
        # O_NONBLOCK: a FIFO put in place of a page must not wait for a writer.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | self._open_flags
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None, FailureReason.MISSING
        except OSError:
            return None, FailureReason.IO_ERROR
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None, FailureReason.IO_ERROR
        if not S_ISREG(info.st_mode):
            os.close(fd)
            return None, FailureReason.NOT_REGULAR_FILE
        fault = length_fault(info.st_size, self._file_bytes)
        if fault is not None:
            os.close(fd)
            unlink_quietly(path)  # not a file of ours (or of the other mode): make room for one
            return None, fault
        return fd, None

    def _read_batch(
        self, regions: PageRegions, keys: Sequence[bytes], pages: list[int], fds: list[int]
    ) -> tuple[int, CountedReason | None]:
        """Read the first ``len(fds)`` pages; (pages verified, the fault that ended them)."""
        assert self._trailers is not None
        with self._trailers.borrow() as slots:
            memory, files = self._descriptors(regions, pages[: len(fds)], fds, slots)
            try:
                self._agent.transfer(
                    "READ", memory, files, fds, self._file_bytes, self.settings.transfer_timeout_s
                )
            except TransferFailed as failure:
                return 0, failure.reason
            for i in range(len(fds)):
                header = slots.view(i)[:HEADER_BYTES]
                fault = regions.check_read(header, pages[i], keys[i], self.settings.verify_checksum)
                if fault is not None:
                    unlink_quietly(self._path(object_name(keys[i], regions.order)))
                    return i, fault
        return len(fds), None

    def _write_batch(
        self, regions: PageRegions, keys: list[bytes], pages: list[int], paths: list[str]
    ) -> FailureReason | None:
        """Write pages to temporaries, then rename them into place; the failure reason or None."""
        assert self._trailers is not None
        temps = [
            f"{os.path.dirname(path)}/"
            f"{temp_name(os.path.basename(path), os.getpid(), threading.get_ident())}"
            for path in paths
        ]
        fds: list[int] = []
        try:
            for temp in temps:
                fds.append(create_file(temp, self._open_flags))
        except OSError:
            for fd in fds:
                os.close(fd)
            for temp in temps[: len(fds)]:
                unlink_quietly(temp)
            return FailureReason.IO_ERROR
        reason: FailureReason | None = None
        with self._trailers.borrow() as slots:
            for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
                digest = regions.checksum(page)
                slot = slots.view(i)
                pack_header_into(slot, 0, key, regions.order, regions.page_bytes, digest)
                if len(slot) > HEADER_BYTES:  # O_DIRECT's padding: a read may have left bytes
                    slot[HEADER_BYTES:] = bytes(len(slot) - HEADER_BYTES)
            memory, files = self._descriptors(regions, pages, fds, slots)
            try:
                self._agent.transfer(
                    "WRITE", memory, files, fds, self._file_bytes, self.settings.transfer_timeout_s
                )
            except TransferFailed as failure:
                reason = failure.reason
            finally:
                for fd in fds:
                    os.close(fd)
        if reason is None:
            try:
                for temp, path in zip(temps, paths, strict=True):
                    os.replace(temp, path)
            except OSError:
                reason = FailureReason.IO_ERROR
        if reason is not None:
            for temp in temps:
                unlink_quietly(temp)
        return reason

    def _descriptors(
        self, regions: PageRegions, pages: list[int], fds: list[int], slots: TrailerSlots
    ) -> tuple[np.ndarray, np.ndarray]:
        """DRAM and FILE descriptor arrays (Nx3) of whole pages: regions, then the trailer."""
        per_page = regions.num_regions + 1
        memory = np.zeros((len(pages) * per_page, 3), dtype=np.uint64)
        files = np.zeros_like(memory)
        region_bytes = regions.region_bytes
        file_offsets = [k * region_bytes for k in range(regions.num_regions)]
        row = 0
        for i, (page, fd) in enumerate(zip(pages, fds, strict=True)):
            for address, offset in zip(regions.addresses(page), file_offsets, strict=True):
                memory[row] = (address, region_bytes, 0)
                files[row] = (offset, region_bytes, fd)
                row += 1
            memory[row] = (slots.address(i), self._trailer_bytes, 0)
            files[row] = (regions.page_bytes, self._trailer_bytes, fd)
            row += 1
        return memory, files

    def _probe_direct_io(self) -> None:
        """Refuse a file system that has no O_DIRECT (some tmpfs and FUSE ones): every
        page would otherwise be an I/O error."""
        probe = f"{self._root_text}/.direct-io-probe-{os.getpid()}-{threading.get_ident()}"
        try:
            os.close(create_file(probe, self._open_flags))
        except OSError as error:
            raise StorageError(
                f"nixl storage: direct_io: the file system of {self.settings.path} refuses "
                f"O_DIRECT "
                f"({error}); use direct_io false or another directory"
            ) from error
        finally:
            unlink_quietly(probe)

    def _fan_out_dirs(self) -> list[str]:
        try:
            return [
                entry.path for entry in os.scandir(self.settings.path)
                if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False)
            ]
        except OSError:
            return []

    def _remove_stale_temporaries(self) -> None:
        now = time.time()
        for sub in self._fan_out_dirs():
            with os.scandir(sub) as entries:
                for entry in entries:
                    if not (entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX)):
                        continue  # temp_name's shape: anything else is not ours to judge
                    with contextlib.suppress(OSError):
                        age_s = now - entry.stat(follow_symlinks=False).st_mtime
                        if is_stale_temp(entry.name, age_s):
                            unlink_quietly(entry.path)


def _check_direct_alignment(regions: PageRegions) -> None:
    align = DIRECT_ALIGN_BYTES
    if not regions.aligned(align):
        raise StorageError(
            f"nixl storage: direct_io needs every page region at a {align}-byte aligned "
            f"address and a multiple of {align} bytes long; this host pool's regions are "
            f"{regions.region_bytes} bytes (pool at address {regions.base_address:#x}, pages "
            f"{regions.page_stride_bytes} bytes apart). Use direct_io false, or a page size "
            f"whose regions are {align}-byte multiples"
        )


