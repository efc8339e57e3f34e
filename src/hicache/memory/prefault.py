"""Pageable host memory faulted in ahead of use: the L2 pool without a GPU.

A pool taken from ``np.empty`` is only reserved: the kernel finds and zeroes each
4 KiB page the first time it is written. For the KV pool that is the first
write-through of every page, on the controller's thread, while the forward
runs: measured on this project's 2-core CPU machine (docs/benchmarks.md), the
first copy of 218 MB into fresh memory took 238 ms against 12 ms into touched
memory. A pinned pool (CUDA) is committed when it is pinned; an unpinned one
gets the same for the pages it hands out first:

- ``pageable``: a private anonymous mapping aligned to 2 MiB. Private, because
  Python's ``mmap`` maps anonymous memory shared by default, which is shmem: transparent
  huge pages skip it (``shmem_enabled`` is rarely on) and its first touch costs more.
  Not advised for huge pages: on this project's CPU machine (a VM that hands freed
  memory back to its host) a first write into fresh memory cost 0.37-0.41 s/GB in
  4 KiB private pages, 0.54-1.77 s/GB in huge pages and 0.58-0.74 s/GB shared; in the
  server, the write-through thread of the prefix workload spent 3.8 s of CPU storing
  3,611 pages into fresh 4 KiB private memory, 5.5 s with huge pages, 5.2 s shared
  (docs/benchmarks.md);
- ``prefault``: the memory of the lowest page ids (the allocator hands those out
  first) is populated before the pool is used: ``MADV_POPULATE_WRITE`` fills the
  page tables as writes would, without writing a byte. The rest is populated a
  piece at a time while the engine has nothing to compute (``HostPool.fault_in_more``,
  from the scheduler's wait for work), and on first use where the engine never idles
  that long. Populating it all up front would commit the whole pool at start (6.5 s
  for 6 GB here), and doing it on a background thread, even at idle priority,
  slowed the serving threads it ran beside on this 2-core machine (measured).

Where the kernel lacks ``MADV_POPULATE_WRITE`` (Linux < 5.14) nothing is
populated.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable

import numpy as np

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h; Python 3.11's mmap module does not name it

_libc: ctypes.CDLL | None = None
_populate_works = True


def pageable(nbytes: int) -> np.ndarray:
    """``nbytes`` of uninitialised private host memory, 2 MiB aligned (a uint8 array; the
    mapping lives as long as any view of it)."""
    # Private: Python's default (MAP_SHARED) makes anonymous memory shmem, whose first
    # touch costs more (module doc).
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE
    return whole[start : start + nbytes]


def prefault(ranges: Iterable[tuple[int, int]]) -> int:
    """Populate each (address, length) range for writing, in order; the bytes populated
    (fewer where the kernel cannot)."""
    done = 0
    for address, length in ranges:
        if not populate(address, length):
            break
        done += length
    return done


def populate(address: int, length: int) -> bool:
    """Fault in ``[address, address + length)`` for writing without touching its bytes;
    False (once logged) where the kernel cannot."""
    global _libc, _populate_works
    if not _populate_works or length <= 0:
        return _populate_works
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    # madvise takes whole pages (EINVAL otherwise): a piece of a pool may start mid-page.
    start = address - address % mmap.PAGESIZE
    length += address - start
    if _libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (0, 22, 38):  # EINVAL/ENOSYS: an older kernel; never retry
        _populate_works = False
        logger.info("host memory is faulted in on use (MADV_POPULATE_WRITE unsupported)")
    else:  # ENOMEM and the like: the rest is faulted in on use
        logger.warning("pre-faulting host memory stopped: errno %d", error)
    return False
