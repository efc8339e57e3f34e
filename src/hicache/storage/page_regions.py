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

Sealing (``storage.sealing``) goes through here as well, when the backend was
given a ``Sealer``: ``frame`` then seals the page into a staging buffer and
answers that buffer as the payload, and ``check_header`` / ``check_landed`` check a
sealed header and open the page in place. A backend that encodes and checks its
frames only through ``frame``, ``header_bytes``, ``check_header`` and ``check_landed``
(or ``check_read``) seals and opens every page without knowing of it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.frame import (
    Buffer,
    Fault,
    PayloadOrder,
    check_header,
    checksum,
    encode_header,
    header_bytes,
    header_checksum,
)

if TYPE_CHECKING:  # imports cryptography: only backends given a sealer load it
    from hicache.storage.sealing import Sealer


# A page's object: (payload fragments, header).
Framed = tuple[list[memoryview], bytes]

# xxhash releases the GIL only for inputs above 64 KiB (python-xxhash's threshold): a
# page of smaller regions (layer_first with small pages or few heads: a Qwen3-0.6B
# region of 16 tokens is 32 KiB) would be hashed region by region with the GIL held,
# which on a GPU server takes the scheduler thread's GIL for as long as the hash runs
# (on an H200 the L3 read thread held it longer than the scheduler did). Such pages are
# gathered into a staging buffer by one torch copy (no GIL) and hashed in one call.
GIL_FREE_HASH_BYTES = 64 * 1024


class PageRegions:
    """Byte regions of every page of one host pool (offsets into ``host.flat``)."""

    def __init__(self, host: HostPool, sealer: Sealer | None = None) -> None:
        self.sealer = sealer
        # Bytes of the header trailing each object (sealed headers are longer).
        self.header_bytes = header_bytes(sealer is not None)
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
        # Every page as one strided uint8 view [page][layer, plane, region byte] (payload
        # order), for the gathered hash; None when regions are hashed in place.
        self._gather_pages: torch.Tensor | None = None
        if (len(self.region_offsets) > 1 and self.region_bytes <= GIL_FREE_HASH_BYTES
                < self.page_bytes):
            self._gather_pages = torch.as_strided(
                host.flat.view(torch.uint8),
                (host.num_pages, geometry.num_layers, geometry.kv_planes, self.region_bytes),
                (self.page_stride_bytes, strides.layer * element_bytes,
                 strides.kv * element_bytes, 1),
            )
        self._staging = threading.local()

    @property
    def gathers_to_hash(self) -> bool:
        """Is a page gathered into a staging buffer to be hashed (``hash_page``)?"""
        return self._gather_pages is not None

    @property
    def num_regions(self) -> int:
        return len(self.region_offsets)

    def aligned(self, align: int) -> bool:
        """Does every region of every page start at an ``align``-byte aligned address and
        run a whole number of ``align`` bytes (what direct I/O asks of its buffers)?"""
        values = [self.base_address, self.page_stride_bytes, self.region_bytes]
        return not any(value % align for value in [*values, *self.region_offsets])

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

    # ------------------------------------------------------------ frames
    def frame(
        self, page: int, key: bytes, staging: memoryview | None = None
    ) -> Framed | None:
        """Page ``page``'s object for key ``key`` as (payload fragments, header): its
        regions and plain header, or, when sealing, its ciphertext in ``staging``
        (``page_bytes`` of a ``staging_for`` buffer) and sealed header. None when the
        page may not be written (its tenant has no key: counted by the caller)."""
        if self.sealer is None:
            return self.views(page), encode_header(
                key, self.order, self.page_bytes, self.checksum(page)
            )
        assert staging is not None, "a sealing backend passes a staging buffer"
        out = staging[: self.page_bytes]
        header = self.sealer.seal(key, self.order, self.views(page), out)
        return None if header is None else ([out], header)

    def staging_for(self, pages: int) -> memoryview | None:
        """A buffer of ``pages`` pages to seal into (this thread's, reused), or None when
        pages are not sealed. Page ``j`` of a batch seals into ``page_slice(buffer, j)``."""
        if self.sealer is None:
            return None
        return self.sealer.staging(pages * self.page_bytes)

    def page_slice(self, staging: memoryview | None, index: int) -> memoryview | None:
        if staging is None:
            return None
        return staging[index * self.page_bytes : (index + 1) * self.page_bytes]

    def check_header(self, header: Buffer, key: bytes) -> Fault | None:
        """The fault in an object's ``header`` (sealed or plain, as this instance writes)
        for page ``key``, or None."""
        return check_header(header, key, self.order, self.page_bytes, self.sealer is not None)

    # ------------------------------------------------------------ checksums
    def checksum(self, page: int) -> bytes:
        """Page ``page``'s payload checksum for its frame: the one the cache took while
        copying the page into the pool when it did, else hashed now."""
        digest = self.digests.digest(page)
        return digest if digest is not None else self.hash_page(page)

    def hash_page(self, page: int) -> bytes:
        """The checksum of page ``page``'s payload as it is in the pool now (``checksum``
        of its regions), computed without holding the GIL for long (``GIL_FREE_HASH_BYTES``)."""
        pages = self._gather_pages
        if pages is None:
            return checksum(self.views(page))
        # This thread's staging page, and the same bytes as one flat memoryview (made once:
        # every torch call made here lets the GIL go and waits to take it back).
        local = self._staging
        staged: torch.Tensor | None = getattr(local, "staged", None)
        if staged is None:
            staged = local.staged = torch.empty(pages.shape[1:], dtype=torch.uint8)
            local.payload = staged.view(-1).numpy().data
        staged.copy_(pages[page])
        # One call over the whole page: xxhash hashes it with the GIL released.
        return checksum([local.payload])

    def check_read(
        self, header: Buffer, page: int, key: bytes, verify_checksum: bool
    ) -> Fault | None:
        """The fault of page ``page``, just read into the pool with frame ``header``: the
        header's (magic, version, order, key, length), then ``check_landed``'s."""
        fault = self.check_header(header, key)
        return fault if fault is not None else self.check_landed(header, page, verify_checksum)

    def land(
        self, header: Buffer, page: int, payload: Buffer, verify_checksum: bool
    ) -> Fault | None:
        """Put ``payload`` (an object's payload a store handed back, with its checked
        ``header``) into page ``page`` and check it: ``copy_in`` and ``check_landed``, or,
        for a sealed page, its decryption from ``payload`` into the page (one pass)."""
        if self.sealer is not None:
            self.digests.forget([page])
            return self.sealer.open(header, self.views(page), payload)
        self.copy_in(page, payload)
        return self.check_landed(header, page, verify_checksum)

    def check_landed(self, header: Buffer, page: int, verify_checksum: bool) -> Fault | None:
        """The payload's fault, if any, of page ``page`` read into the pool with a checked
        ``header``. Without ``verify_checksum`` nothing is checked (and nothing known of
        the page's checksum); when the cache's loads check L3 pages
        (``digests.defer_checks``) the header's checksum is recorded for that check;
        otherwise the page is hashed here. A sealed page is opened instead (decrypted
        in place): its tag, not a checksum, says whether it is whole, whatever
        ``verify_checksum`` says."""
        digests = self.digests
        if self.sealer is not None:
            digests.forget([page])  # no checksum is known of it either way
            return self.sealer.open(header, self.views(page))
        if not verify_checksum:
            digests.forget([page])
            return None
        digest = header_checksum(header)
        if digests.defer_checks:
            digests.expect(page, digest)
            return None
        if self.hash_page(page) != digest:
            digests.forget([page])
            return Fault.CORRUPT
        digests.set_known(page, digest)
        return None
