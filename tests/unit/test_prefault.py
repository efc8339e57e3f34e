"""Host memory faulted in ahead of use (``memory.prefault``, ``HostPool``): the pages the
allocator hands out first are resident before any write, and populating writes nothing."""

from __future__ import annotations

import ctypes
import mmap
import re

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory import host_pool as host_pool_module
from hicache.memory import prefault
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool

_PAGE = mmap.PAGESIZE


def resident(address: int, length: int) -> float:
    """Share of the memory pages of [address, address + length) that are resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    first = address - address % _PAGE
    pages = -(-(address + length - first) // _PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(first, pages * _PAGE, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


@pytest.fixture(autouse=True)
def _needs_populate() -> None:
    probe = prefault.pageable(_PAGE)
    if not prefault.populate(probe.ctypes.data, _PAGE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")


def test_pageable_is_aligned_for_huge_pages_and_untouched() -> None:
    memory = prefault.pageable(32 << 20)
    assert memory.nbytes == 32 << 20 and memory.ctypes.data % (2 << 20) == 0
    assert resident(memory.ctypes.data, memory.nbytes) < 0.5  # reserved, not faulted in


def _mapping_of(address: int) -> tuple[str, dict[str, str]]:
    """The permissions of the mapping holding ``address`` and its smaps fields."""
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        lines = smaps.read().splitlines()
    header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)")
    for i, line in enumerate(lines):
        match = header.match(line)
        if match is None or not int(match[1], 16) <= address < int(match[2], 16):
            continue
        details: dict[str, str] = {}
        for detail in lines[i + 1 :]:
            if header.match(detail):  # the next mapping
                break
            key, _, value = detail.partition(":")
            details[key.strip()] = value.strip()
        return match[3], details
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pageable_is_private_memory() -> None:
    """Python's mmap maps anonymous memory shared unless told: shmem, whose first touch
    costs more. The pool must be private (and counted as anonymous memory)."""
    memory = prefault.pageable(8 << 20)
    memory[: 1 << 20] = 1
    permissions, details = _mapping_of(memory.ctypes.data)
    assert permissions.endswith("p"), permissions
    assert details["Anonymous"] != "0 kB", details


def test_prefault_populates_the_ranges_given_and_writes_nothing() -> None:
    memory = prefault.pageable(16 << 20)
    memory[: 1 << 20] = 9  # already written: populating must keep it
    base = memory.ctypes.data
    ranges = [(base, 2 << 20), (base + (8 << 20), 2 << 20)]
    assert prefault.prefault(ranges) == 4 << 20
    assert resident(base, 2 << 20) == 1.0 and resident(base + (8 << 20), 2 << 20) == 1.0
    assert resident(base + (4 << 20), 2 << 20) < 0.5  # between the ranges: untouched
    assert (memory[: 1 << 20] == 9).all() and not memory[1 << 20 : 2 << 20].any()


def _pool_of_1024_pages(
    monkeypatch: pytest.MonkeyPatch, layout: MemLayout
) -> tuple[HostPool, int]:
    """A host pool of 1,024 64 KiB pages whose first 64 are faulted in when it is made;
    and its page size in bytes."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    page_bytes = geometry.page_bytes(16)
    monkeypatch.setattr(host_pool_module, "PREFAULT_BYTES", 64 * page_bytes)
    return HostPool(geometry, 1024, 16, layout=layout, pin_memory=False), page_bytes


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_a_host_pool_has_its_first_pages_resident(
    monkeypatch: pytest.MonkeyPatch, layout: MemLayout
) -> None:
    pool, page_bytes = _pool_of_1024_pages(monkeypatch, layout)
    first = pool.pages[:64]
    later = pool.pages[512:]
    # Every byte of pages 0..63 (wherever the layout puts them) is resident ...
    for page in range(64):
        for layer in range(pool.geometry.num_layers):
            for plane in range(pool.geometry.kv_planes):
                piece = first[page, layer, plane]
                assert resident(piece.data_ptr(), piece.numel() * 4) == 1.0
    # ... and most of the pool is not (it is faulted in on use, as before).
    flat_later = [later[:, layer, plane] for layer in range(4) for plane in range(2)]
    fractions = [resident(t.data_ptr(), 512 * page_bytes // 8) for t in flat_later]
    assert np.mean(fractions) < 0.5, fractions


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_a_host_pool_faults_in_the_rest_a_piece_at_a_time(
    monkeypatch: pytest.MonkeyPatch, layout: MemLayout
) -> None:
    pool, page_bytes = _pool_of_1024_pages(monkeypatch, layout)
    assert pool.faulted_pages == 64

    def fraction_resident(first: int, stop: int) -> float:
        pieces = [pool.pages[first:stop, layer, plane] for layer in range(4) for plane in range(2)]
        return float(np.mean([resident(p.data_ptr(), (stop - first) * page_bytes // 8)
                              for p in pieces]))

    assert fraction_resident(64, 128) < 0.5
    assert pool.fault_in_more(64 * page_bytes + 1)  # whole pages: 64 of them, more left
    assert pool.faulted_pages == 128
    assert fraction_resident(64, 128) == 1.0
    assert fraction_resident(512, 1024) < 0.5  # not yet
    pieces = 0
    while pool.fault_in_more(256 * page_bytes):
        pieces += 1
    assert pieces == 3 and pool.faulted_pages == 1024
    assert fraction_resident(0, 1024) == 1.0
    assert not pool.fault_in_more(page_bytes)  # nothing left


def test_ranges_that_start_mid_page_are_populated_too() -> None:
    memory = prefault.pageable(4 << 20)
    base = memory.ctypes.data
    assert prefault.populate(base + 100, 3 * _PAGE)  # not page aligned: still done
    assert resident(base, 4 * _PAGE) == 1.0
    assert prefault._populate_works  # and it did not switch populating off for the process
