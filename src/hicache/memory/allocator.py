"""Page allocator: hands out page ids of one pool and takes them back.

Page ids are int64 numpy arrays everywhere in the cache bookkeeping (cheap to
slice and concatenate on the CPU; ``torch.from_numpy`` makes them tensors
without a copy when a transfer needs them).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

PageIds = npt.NDArray[np.int64]


class OutOfPagesError(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than asked for."""


class PageAllocator:
    """Free-list allocator over pages ``[0, num_pages)``.

    Allocation prefers low page ids in ascending order, so pages allocated
    together tend to form contiguous runs; the direct io backend copies a run
    with one copy instead of one per page.
    """

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages < 1:
            raise ValueError(f"{name}: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.name = name
        self._free: PageIds = np.arange(num_pages, dtype=np.int64)
        # Pages freed since the last sort; merged lazily on the next allocate.
        self._released: list[PageIds] = []
        self._num_released = 0
        self._allocated = np.zeros(num_pages, dtype=np.bool_)
        self.num_reserved_pages = 0  # see reserve

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + self._num_released

    @property
    def num_used_pages(self) -> int:
        """Pages handed out by ``allocate`` and not freed (reserved ones not counted)."""
        return self.num_pages - self.num_free_pages - self.num_reserved_pages

    def reserve(self, num_pages: int) -> PageIds:
        """Take ``num_pages`` pages out of circulation for good (scratch space of the
        engine's own, never cached or freed): allocated, but not among the used pages
        whose owners ``num_used_pages`` accounts for."""
        pages = self.allocate(num_pages)
        self.num_reserved_pages += num_pages
        return pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> PageIds:
        """Return ``num_pages`` distinct free page ids; raise OutOfPagesError if short."""
        if num_pages < 0:
            raise ValueError(f"{self.name}: cannot allocate {num_pages} pages")
        if num_pages > self.num_free_pages:
            raise OutOfPagesError(
                f"{self.name}: asked for {num_pages} pages, {self.num_free_pages} free"
            )
        if num_pages > len(self._free):
            self._merge_released()
        pages: PageIds = self._free[:num_pages].copy()
        self._free = self._free[num_pages:]
        self._allocated[pages] = True
        return pages

    def free(self, pages: PageIds) -> None:
        """Return pages to the pool; freeing a page that is not allocated is an error."""
        if len(pages) == 0:
            return
        pages = np.asarray(pages, dtype=np.int64)
        if not self._allocated[pages].all() or len(np.unique(pages)) != len(pages):
            raise ValueError(f"{self.name}: double free or foreign page in {pages.tolist()[:16]}")
        self._allocated[pages] = False
        self._released.append(pages.copy())
        self._num_released += len(pages)

    def _merge_released(self) -> None:
        if not self._released:
            return
        self._free = np.sort(np.concatenate([self._free, *self._released]))
        self._released.clear()
        self._num_released = 0

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def all_allocated(self, pages: PageIds) -> bool:
        """Are all of ``pages`` allocated (one vectorized lookup)?"""
        return bool(self._allocated[pages].all())

    def check_integrity(self) -> None:
        """Every page is either free exactly once or allocated; raises AssertionError if not.

        Linear in the pool (a mask, no sort): a small model's pool on a large GPU holds
        a hundred million pages, which sorting took minutes to check."""
        free = np.concatenate([self._free, *self._released]) if self._released else self._free
        seen = np.zeros(self.num_pages, dtype=np.bool_)
        seen[free] = True
        assert int(np.count_nonzero(seen)) == len(free), f"{self.name}: a page is free twice"
        assert not np.logical_and(seen, self._allocated).any(), (
            f"{self.name}: a free page is marked allocated"
        )
        num_allocated = int(np.count_nonzero(self._allocated))
        assert len(free) + num_allocated == self.num_pages, (
            f"{self.name}: {len(free)} free + {num_allocated} allocated != {self.num_pages} pages"
        )
