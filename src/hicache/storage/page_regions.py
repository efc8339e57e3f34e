"""Where each host page's bytes live in the pool's flat buffer, for zero-copy L3 I/O.

A page is never copied to move it to or from L3: backends hand the store the
page's own memory. With page_first layouts a page is one contiguous region.
With layer_first it is ``planes * layers`` regions, one per (layer, plane), each the
page's ``page_size`` consecutive rows (contiguous because a row follows the
previous token's row in every layout). Backends pass these regions as one
scatter/gather list (``readv``/``writev`` for files, multi-buffer batch calls
for Mooncake) instead of staging the page in a bounce buffer: that saves one
memory copy of every page moved, and needs no extra memory.

Regions are listed in payload order (``frame.PayloadOrder``): the concatenation
of a page's regions is its payload.

The payload checksum goes through here too (``checksum``, ``check_read``): a
page the cache checksummed while copying it into the pool is not hashed again
for its frame, and a page read from L3 is verified by the cache's load when the
cache does that (``memory.page_digests``), not by a hash pass of its own here.
"""

from __future__ import annotations

import torch

from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.frame import (
    Buffer,
    Fault,
    PayloadOrder,
    check_header,
    checksum,
    header_checksum,
)


class PageRegions:
    """Byte regions of every page of one host pool (offsets into ``host.flat``)."""

    def __init__(self, host: HostPool) -> None:
        geometry = host.geometry
        strides = host.strides
        element_bytes = geometry.element_bytes
        if not host.flat.is_contiguous() or host.flat.device.type != "cpu":
            raise StorageError("L3 backends need the host pool's flat buffer in CPU memory")
        self.order = PayloadOrder.of_layout(host.layout)
        self.page_bytes = host.page_bytes
        self.page_stride_bytes = strides.page * element_bytes
        if strides.page_contiguous:
            self.region_offsets = [0]
            self.region_bytes = self.page_bytes
        elif strides.token == geometry.row_elems:
            # layer_first: one region per (layer, plane), in layer-major order.
            self.region_offsets = [
                (layer * strides.layer + kv * strides.kv) * element_bytes
                for layer in range(geometry.num_layers)
                for kv in range(geometry.kv_planes)
            ]
            self.region_bytes = host.page_size * geometry.row_elems * element_bytes
        else:
            raise StorageError(f"host layout {host.layout.value}: a page's rows are not contiguous")
        assert self.region_bytes * len(self.region_offsets) == self.page_bytes
        # [pool bytes] uint8 view of the pool; memoryview slices of it are the
        # page regions themselves (writable: reads land in the pool).
        self._pool: memoryview = host.flat.view(torch.uint8).numpy().data
        self.base_address = host.flat.data_ptr()
        self.pool_bytes = host.size_bytes
        self.digests = host.digests

    @property
    def num_regions(self) -> int:
        return len(self.region_offsets)

    def offsets(self, page: int) -> list[int]:
        """Byte offsets of page ``page``'s regions in the pool, in payload order."""
        start = page * self.page_stride_bytes
        return [start + offset for offset in self.region_offsets]

    def views(self, page: int) -> list[memoryview]:
        """The page's regions as writable memoryviews of the pool (no copy)."""
        size = self.region_bytes
        return [self._pool[offset : offset + size] for offset in self.offsets(page)]

    def addresses(self, page: int) -> list[int]:
        """The page's regions as absolute addresses (for stores that take pointers)."""
        base = self.base_address
        return [base + offset for offset in self.offsets(page)]

    def copy_in(self, page: int, payload: Buffer) -> None:
        """Copy ``payload`` (at least ``page_bytes``, in payload order) into page ``page``,
        for stores that hand back their own copy of an object instead of filling ours."""
        size = self.region_bytes
        for k, view in enumerate(self.views(page)):
            view[:] = payload[k * size : (k + 1) * size]

    def copy_out(self, page: int, target: memoryview) -> None:
        """Copy page ``page``'s payload into ``target[:page_bytes]`` (a store's buffer)."""
        size = self.region_bytes
        for k, view in enumerate(self.views(page)):
            target[k * size : (k + 1) * size] = view

    # ------------------------------------------------------------ checksums
    def checksum(self, page: int) -> bytes:
        """Page ``page``'s payload checksum for its frame: the one the cache took while
        copying the page into the pool when it did, else hashed now."""
        digest = self.digests.digest(page)
        return digest if digest is not None else checksum(self.views(page))

    def check_read(
        self, header: Buffer, page: int, key: bytes, verify_checksum: bool
    ) -> Fault | None:
        """The fault of page ``page``, just read into the pool with frame ``header``: the
        header's (magic, version, order, key, length), then ``check_landed``'s."""
        fault = check_header(header, key, self.order, self.page_bytes)
        return fault if fault is not None else self.check_landed(header, page, verify_checksum)

    def check_landed(self, header: Buffer, page: int, verify_checksum: bool) -> Fault | None:
        """The payload's fault, if any, of page ``page`` read into the pool with a checked
        ``header``. Without ``verify_checksum`` nothing is checked (and nothing known of
        the page's checksum); when the cache's loads check L3 pages
        (``digests.defer_checks``) the header's checksum is recorded for that check;
        otherwise the page is hashed here."""
        digests = self.digests
        if not verify_checksum:
            digests.forget([page])
            return None
        digest = header_checksum(header)
        if digests.defer_checks:
            digests.expect(page, digest)
            return None
        if checksum(self.views(page)) != digest:
            digests.forget([page])
            return Fault.CORRUPT
        digests.set_known(page, digest)
        return None
