"""Host (L2) KV pool: paged, in one of three layouts, pinned when CUDA is present."""

from __future__ import annotations

import logging

import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageAllocator
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_memory import empty_host
from hicache.memory.layout import PageStrides, canonical_view, page_strides
from hicache.memory.page_digests import PageDigests
from hicache.memory.prefault import prefault

logger = logging.getLogger(__name__)

# Without pinning, the memory of this many bytes of the lowest page ids is faulted in
# when the pool is made (``memory.prefault``): a write-through into fresh memory pays the
# kernel's page faults on the controller's thread, several times the copy itself.
PREFAULT_BYTES = 512 << 20
# How much of the rest the scheduler faults in at a time while it has nothing to compute
# (``fault_in_more``): a request that arrives meanwhile waits at most this long (8 MiB:
# ~3 ms on this project's CPU machine, at 0.4 s/GB).
IDLE_FAULT_BYTES = 8 << 20


class HostPool:
    """KV of ``num_pages`` pages in host memory.

    ``pages`` is the canonical view ``[num_pages, layers, kv_planes, page_size, row]``
    whatever the layout. With page_first layouts ``page_span(p)`` is the page as
    one contiguous 1-D tensor: the unit handed to L3 storage without a copy.
    """

    def __init__(
        self, geometry: KVGeometry, num_pages: int, page_size: int, layout: MemLayout,
        pin_memory: bool | None = None,
    ) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = MemLayout(layout)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        numel = num_pages * self.page_elems
        # Pinned memory is what lets the GPU DMA (and Triton kernels) read the pool
        # directly; without CUDA it is plain pageable memory.
        self.flat = empty_host(numel, geometry.dtype, pin_memory)
        self.pinned = pin_memory
        self.strides: PageStrides = page_strides(self.layout, geometry, num_pages, page_size)
        self.pages = canonical_view(self.flat, self.strides, geometry, num_pages, page_size)
        self.allocator = PageAllocator(num_pages, name="host pool")
        # Each page's L3 payload checksum, where known (memory.page_digests).
        self.digests = PageDigests(num_pages)
        # Pages [0, faulted_pages) are resident (a pinned pool is committed whole).
        self.faulted_pages = num_pages
        if not pin_memory:
            # The pages handed out first now, the rest while the server is idle.
            self.faulted_pages = 0
            self.fault_in_more(PREFAULT_BYTES)
        logger.info(
            "host pool: %d pages x %d tokens, %s, %.3f GB%s", num_pages, page_size,
            self.layout.value, self.size_bytes / 1e9, " pinned" if pin_memory else "",
        )

    def fault_in_more(self, max_bytes: int) -> bool:
        """Fault in the memory of the next pages past ``faulted_pages`` (the allocator hands
        out the lowest ids first), ``max_bytes`` of them (at least one page); True while
        pages are left to fault in. Where the kernel cannot, the rest is faulted in on
        first use and this stops."""
        first = self.faulted_pages
        if first >= self.num_pages:
            return False
        stop = min(self.num_pages, first + max(1, max_bytes // self.page_bytes))
        ranges = self._pages_memory(first, stop)
        if not ranges or prefault(ranges) < sum(length for _, length in ranges):
            self.faulted_pages = self.num_pages  # nothing more to gain: do not retry
            return False
        self.faulted_pages = stop
        return stop < self.num_pages

    def _pages_memory(self, first: int, stop: int) -> list[tuple[int, int]]:
        """(address, length) of the memory of pages [first, stop), in address order within
        each piece."""
        if stop <= first:
            return []
        base, elem = self.flat.data_ptr(), self.flat.element_size()
        strides, geometry = self.strides, self.geometry
        if strides.page_contiguous:
            return [(base + first * self.page_bytes, (stop - first) * self.page_bytes)]
        if strides.page != self.page_size * geometry.row_elems:
            return []  # no layout is like this today; nothing to gain from guessing
        # layer_first: in each (layer, plane) region a page's rows follow the previous page's.
        run = (stop - first) * strides.page * elem
        offset = first * strides.page
        return [
            (base + (layer * strides.layer + plane * strides.kv + offset) * elem, run)
            for layer in range(geometry.num_layers)
            for plane in range(geometry.kv_planes)
        ]

    @property
    def page_elems(self) -> int:
        geometry = self.geometry
        return self.page_size * geometry.num_layers * geometry.kv_planes * geometry.row_elems

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes(self.page_size)

    @property
    def size_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def page_span(self, page: int) -> torch.Tensor:
        """Page ``page`` as one contiguous 1-D tensor (page_first layouts only)."""
        if not self.strides.page_contiguous:
            raise ValueError(f"layout {self.layout.value} does not store a page contiguously")
        start = page * self.strides.page
        return self.flat[start : start + self.page_elems]

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
