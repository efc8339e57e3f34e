"""Pageable host memory committed up front: the L2 pool without a GPU.

A pool taken from ``np.empty`` is only reserved: the kernel finds and zeroes each
4 KiB page the first time it is written. For the KV pool that is the first
write-through of every page, on the controller's thread, while the forward
runs: measured on this project's 2-core CPU machine (docs/benchmarks.md), the
first copy of 218 MB into fresh memory took 238 ms against 12 ms into touched
memory, and in a multi-turn run on one core the write thread spent about a
second of the run there. A pinned pool (CUDA) is committed when it is pinned;
this gives an unpinned one the same:

- the memory is an anonymous mapping aligned to 2 MiB and advised
  ``MADV_HUGEPAGE``, so the kernel backs it with huge pages where transparent huge
  pages are on (half the cost per byte of 4 KiB faults, measured);
- its first ``SYNC_BYTES`` are populated before the pool is returned
  (``MADV_POPULATE_WRITE``: the page tables are filled as by writes, no byte is
  written), the pages the allocator hands out first (lowest ids first);
- the rest is populated by a background thread at idle priority (``SCHED_IDLE``:
  it runs only on a core nothing else wants), in steps, until the pool is freed.

Populating never changes the content, so it is safe beside writes into the
pool. Where the kernel lacks ``MADV_POPULATE_WRITE`` (Linux < 5.14) the memory
stays lazily faulted, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h; Python 3.11's mmap module does not name it
# Populated before the pool is handed out; the rest in the background, this much a step.
SYNC_BYTES = 256 << 20
STEP_BYTES = 64 << 20

_libc: ctypes.CDLL | None = None
_populate_works = True


def committed_pageable(
    nbytes: int, sync_bytes: int = SYNC_BYTES, *,
    available: Callable[[], int | None] = lambda: None, reserve: int = 0,
) -> np.ndarray:
    """``nbytes`` of uninitialised, 2 MiB-aligned host memory as a uint8 array, committed
    as the module docstring says: ``sync_bytes`` now, the rest in the background while
    ``available()`` (bytes the machine can still give; None: unknown) stays above
    ``reserve`` (other processes keep their memory; the pool is faulted in on use)."""
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    start = -whole.ctypes.data % _HUGE_PAGE
    window = whole[start : start + nbytes]
    address = int(window.ctypes.data)
    now = min(nbytes, sync_bytes)
    if now and populate(address, now) and nbytes > now:
        _populate_in_background(window, address + now, nbytes - now, available, reserve)
    return window


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
    if _libc.madvise(address, length, _MADV_POPULATE_WRITE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (0, 22, 38):  # EINVAL/ENOSYS: an older kernel; never retry
        _populate_works = False
        logger.info("host memory is faulted in lazily (MADV_POPULATE_WRITE unsupported)")
    else:  # ENOMEM and the like: leave the rest to be faulted in on use
        logger.warning("pre-faulting host memory stopped: %s", os.strerror(error))
    return False


def _populate_in_background(
    window: np.ndarray, address: int, length: int,
    available: Callable[[], int | None], reserve: int,
) -> None:
    # A weak reference: a pool freed meanwhile is not kept alive (and not populated on).
    owner = weakref.ref(window.base if window.base is not None else window)

    def run() -> None:
        _lower_priority()
        done = 0
        while done < length:
            alive = owner()
            if alive is None:
                return
            step = min(STEP_BYTES, length - done)
            free = available()
            if free is not None and free - step < reserve:
                logger.info(
                    "host memory: %.2f GB of the pool left to fault in on use (%.1f GB free)",
                    (length - done) / 1e9, free / 1e9,
                )
                return
            ok = populate(address + done, step)  # ``alive`` holds the mapping meanwhile
            del alive
            if not ok:
                return
            done += step

    threading.Thread(target=run, name="hicache-host-prefault", daemon=True).start()


def _lower_priority() -> None:
    """This thread runs only when a core is otherwise idle (Linux ``SCHED_IDLE``)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    # Not permitted here: a normal-priority thread still helps.
    with contextlib.suppress(OSError):
        os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
