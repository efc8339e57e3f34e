"""Host memory committed up front (``memory.prefault``): resident before use, content untouched."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import numpy as np
import pytest

from hicache.memory import prefault
from hicache.memory.prefault import committed_pageable

_PAGE = mmap.PAGESIZE


def resident_fraction(array: np.ndarray) -> float:
    """Share of ``array``'s memory pages that are resident (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = array.ctypes.data
    assert start % _PAGE == 0
    pages = -(-array.nbytes // _PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, array.nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def prefault_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hicache-host-prefault"]


def wait_until(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_first_part_is_resident_at_once_and_the_rest_soon() -> None:
    sync = 8 << 20
    memory = committed_pageable(64 << 20, sync)
    assert memory.nbytes == 64 << 20 and memory.ctypes.data % (2 << 20) == 0
    if not prefault._populate_works:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert resident_fraction(memory[:sync]) == 1.0
    wait_until(lambda: resident_fraction(memory) == 1.0)
    memory[:] = 7  # writable, and populating wrote nothing over it
    assert int(memory.sum()) == 7 * memory.nbytes


def test_populating_in_the_background_keeps_what_is_written_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefault, "STEP_BYTES", 1 << 20)
    memory = committed_pageable(48 << 20, 1 << 20)
    pattern = np.arange(memory.nbytes, dtype=np.uint64).view(np.uint8)[: memory.nbytes]
    memory[:] = pattern  # races the background thread on purpose
    wait_until(lambda: not prefault_threads())
    assert np.array_equal(memory, pattern)


def test_a_freed_pool_and_a_short_machine_stop_the_background_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not prefault._populate_works:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    # No memory to spare: nothing beyond the synchronous part is populated.
    memory = committed_pageable(32 << 20, 4 << 20, available=lambda: 1 << 30, reserve=2 << 30)
    wait_until(lambda: not prefault_threads())
    assert resident_fraction(memory[4 << 20 :]) < 0.5
    # A pool dropped right away: the thread ends without keeping it alive.
    monkeypatch.setattr(prefault, "STEP_BYTES", 1 << 20)
    committed_pageable(256 << 20, 1 << 20)
    wait_until(lambda: not prefault_threads(), timeout_s=10.0)
