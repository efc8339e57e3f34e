"""PageAllocator contract."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.memory.allocator import OutOfPagesError, PageAllocator


def test_allocate_free_round_trip_prefers_low_contiguous_pages() -> None:
    alloc = PageAllocator(8)
    first = alloc.allocate(3)
    assert first.tolist() == [0, 1, 2]
    second = alloc.allocate(2)
    alloc.free(first)
    assert alloc.num_free_pages == 6 and alloc.can_allocate(6) and not alloc.can_allocate(7)
    # Freed pages are merged back in order, so a later allocation is contiguous again.
    assert alloc.allocate(6).tolist() == [0, 1, 2, 5, 6, 7]
    assert alloc.num_used_pages == 8
    alloc.free(second)
    alloc.check_integrity()


def test_errors_change_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    with pytest.raises(OutOfPagesError, match="asked for 3 pages, 2 free"):
        alloc.allocate(3)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(np.array([pages[0], pages[0]]))
    with pytest.raises(ValueError, match="double free"):
        alloc.free(np.array([3]))
    assert alloc.num_free_pages == 2
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)
    alloc.check_integrity()
    assert alloc.num_free_pages == 4


def test_check_integrity_detects_corruption() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(1)
    alloc._allocated[0] = False  # simulate a lost page
    with pytest.raises(AssertionError, match="free \\+ 0 allocated"):
        alloc.check_integrity()


def test_check_integrity_detects_a_page_free_twice() -> None:
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    alloc.free(pages[:1])
    alloc._released.append(pages[:1].copy())  # the same page released again, unnoticed
    with pytest.raises(AssertionError, match="free twice"):
        alloc.check_integrity()


def test_check_integrity_detects_a_free_page_marked_allocated() -> None:
    alloc = PageAllocator(6)
    alloc.allocate(2)
    alloc._allocated[4] = True  # page 4 is still on the free list
    with pytest.raises(AssertionError, match="free page is marked allocated"):
        alloc.check_integrity()


def test_all_allocated_checks_every_page() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(3)
    assert alloc.all_allocated(pages)
    assert not alloc.all_allocated(np.append(pages, 5))
    assert alloc.all_allocated(pages[:0])
