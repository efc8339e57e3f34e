"""Page payloads written and read with O_DIRECT, past the page cache (the file backend's
``direct_writes`` and ``direct_reads``).

Why. A buffered write copies every page into the page cache (kernel time, and a pass over
memory that pushes the forward's weights and activations out of the CPU caches), the
kernel's writeback then moves it to the disk, and with ext4's ordered journal the next page
file's creation waits behind that writeback. Where the forward runs on the same cores (a
CPU server) all of it is taken from the forward: on this project's 2-vCPU machine the file
L3 at its defaults cost 6-16% of cold prompt throughput with buffered writes, about half of
that with direct ones (docs/benchmarks.md, "direct writes"). A direct write hands the host
page's own memory to the device: no copy, nothing left dirty. It also keeps pages that the
host pool holds anyway from being held a second time by the page cache.

What it needs. Direct I/O moves whole logical blocks: every region of a page must start at
a block-aligned address and be a whole number of blocks long (then each also starts at a
block-aligned offset in the file, the payload being the regions back to back). That is
checked once for the host pool (``usable``, ``PageRegions.aligned``); a pool whose regions
are not (a small page of a small model) is written through the page cache as before. The
header that trails the payload is not block sized: it is written through the page cache
after O_DIRECT is cleared on the descriptor (``fcntl F_SETFL``), so a page file has the same
bytes whichever way it was written, and both read alike.

Reads. A buffered read of a page written directly goes through the page cache on its way
from the disk: the kernel allocates cache pages for it, copies it into the host page, and
keeps the copy, which memory pressure then has to reclaim. On a CPU server that is CPU
taken from the forward: in the default server on this project's 2-vCPU machine (SmolLM2
float32, 737 KiB pages, a prefix workload larger than the host tier; docs/benchmarks.md,
"direct reads") the L3 read thread spent 1.1 s of CPU on ~830 pages, nearly all of it in
``readv``; read directly, 0.1 s, and the workload ran 2-4% faster. A direct read moves the
payload from the disk into the host page and nothing else. So "auto" reads directly
exactly where pages are written directly; the header, like the write's, goes through the
page cache. A page read directly is never served from the page cache: one read again soon
comes from the disk again, which on a CPU server is still cheap next to the cores.

What it costs, and so when it is on. A page written directly is not in the page cache: the
first read of it comes from the disk. On this project's CPU machine (``hicache bench storage
--layout layer_first``, 8 MiB pages) reads of pages just written went at 1.1-1.2 GB/s after
direct writes against 11-12 GB/s from the page cache, and puts at 2.1 GB/s against 4.2-4.6
(the disk's speed against memory's, but the writer's time only: the page cache's copy and
writeback are paid later, on every core). Where the forward runs on the CPU the cores are
what is short, and a load from the disk is still far faster than recomputing (a 1K-token
SmolLM2 prompt: ~47 MB, ~40 ms from this disk, ~1.4 s to recompute), so "auto" (the
default) writes directly there and through the page cache where the forward runs on a GPU,
whose host cores are otherwise idle and whose prefill can beat a slow disk. "auto" leaves
small pages (under ``AUTO_MIN_PAGE_BYTES``) in the page cache too: copying a few KiB costs
microseconds, while a direct write waits for the device every time. A tiny model's 16 KiB
pages went out at 0.85-0.95x the buffered rate (``hicache bench storage --preset tiny``),
and a CPU server under load fell behind with them: the host pool filled with pages waiting
for L3, so the next device->host backups were skipped (262-340 pages of a short multi-turn
run against 194-232 buffered) and those conversations missed both tiers.

A file system or device that refuses direct I/O (EINVAL or EOPNOTSUPP: a file system
without it, a device whose logical blocks are larger than ``ALIGN_BYTES``) costs nothing but
a warning: the page is written (or read) again through the page cache, and so is every
later one, both ways.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Sequence

from hicache.storage.backends.file.vectored import read_all, write_all
from hicache.storage.page_regions import PageRegions

logger = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
# The smallest logical block size of block devices; a larger one refuses (EINVAL), which
# falls back to buffered I/O.
ALIGN_BYTES = 512
# What a file system or device answers direct I/O it does not do (EINVAL from most;
# a few say "not supported"); any other error is the disk's and fails the page as usual.
_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
# Pages smaller than this are written through the page cache under "auto" (module
# docstring). SmolLM2-135M's 16-token pages (368 KiB in bfloat16, 737 KiB in float32) are
# above it; a 16-token page of the tiny test model (16 KiB) is far below.
AUTO_MIN_PAGE_BYTES = 256 * 1024

def usable(regions: PageRegions) -> str | None:
    """Why the pages of ``regions`` cannot be moved directly, or None when they can."""
    if not O_DIRECT:
        return "this OS has no O_DIRECT"
    if not regions.aligned(ALIGN_BYTES):
        return (
            f"the host pool's page regions ({regions.region_bytes} bytes, pages "
            f"{regions.page_stride_bytes} bytes apart) are not {ALIGN_BYTES}-byte aligned"
        )
    return None


class DirectIO:
    """Writes (``writes``) and reads (``reads``) a page's payload directly and its header
    through the page cache, until the file system refuses direct I/O once (then both go
    through the page cache: ``active``); counts the pages moved directly each way."""

    def __init__(self, where: str, writes: bool = True, reads: bool = True) -> None:
        self._where = where  # for the warning: the store's directory
        self._lock = threading.Lock()
        self.writes = writes
        self.reads = reads
        self.active = True
        self.num_direct_pages = 0  # written
        self.num_direct_reads = 0

    def write(self, fd: int, payload: Sequence[memoryview], header: bytes) -> None:
        """Write ``payload`` then ``header`` into ``fd`` (an empty file open for writing,
        without O_DIRECT). Raises ``OSError`` as a buffered write would."""
        if not (self.active and self.writes):
            write_all(fd, [*payload, header])
            return
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
            write_all(fd, payload)
        except OSError as error:
            if error.errno not in _REFUSALS:
                raise
            self._refused(error)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            os.ftruncate(fd, 0)  # whatever part of the payload did land
            os.lseek(fd, 0, os.SEEK_SET)
            write_all(fd, [*payload, header])
            return
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        write_all(fd, [header])
        with self._lock:
            self.num_direct_pages += 1

    def read(self, fd: int, payload: Sequence[memoryview], header: memoryview) -> int:
        """Read ``payload`` then ``header`` from ``fd`` (a page file of exactly their
        length, open for reading without O_DIRECT, at offset 0); the bytes read, as
        ``read_all`` counts them. Raises ``OSError`` as a buffered read would."""
        if not (self.active and self.reads):
            return read_all(fd, [*payload, header])
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
            got = read_all(fd, payload)
        except OSError as error:
            if error.errno not in _REFUSALS:
                raise
            self._refused(error)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            os.lseek(fd, 0, os.SEEK_SET)
            return read_all(fd, [*payload, header])
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        got += read_all(fd, [header])
        with self._lock:
            self.num_direct_reads += 1
        return got

    def _refused(self, error: OSError) -> None:
        with self._lock:
            if not self.active:
                return
            self.active = False
        logger.warning(
            "file storage: %s refuses direct I/O (%s); pages are written and read through "
            "the page cache from now on", self._where, error,
        )
