"""Copies between a CPU device pool and the host pool that checksum the host page on the way.

The L3 frame's checksum (``storage.frame``: xxh3_128 of the page's payload, in
payload order) is taken here while each piece of a page is in the CPU cache
(``memory.page_digests`` says why): the page is copied a piece at a time, small
enough that the copy leaves it cached, and each piece is hashed right after it
was copied. Writing to the host (L1 -> L2) records the page's digest as KNOWN;
loading an EXPECTED page (one read from L3) to the device checks it.

For layer-major host layouts a page is, on both sides, one run of rows per
(layer, plane); a piece is as many whole layers' runs as fit in
``PIECE_BYTES``, or a part of one run where a run alone is larger. Where the
piece's host runs are contiguous (page_first_direct) it is copied by one
strided copy and hashed where it landed; where they lie apart (layer_first) it
is gathered into a per-thread staging buffer, hashed there and copied on. For
page_first (token-major) a piece is a run of whole tokens. Hashing the pieces
in turn is hashing the payload.

Few calls a page matter more than the bytes: every numpy copy and hash call
releases the GIL and takes it back, and on a CPU device the scheduler thread
runs the forward's Python between torch ops on the same GIL. Hashing each of a
layer_first page's runs where it lies (60 calls a page for SmolLM2 at page
size 16) made a thread of small torch ops beside a storing copier ~1.6x slower
than alone; staged (9 calls a page) ~1.2x, for one more copy of the page
(~30 us of 165-195; docs/benchmarks.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

from hicache.memory.allocator import PageIds
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.memory.page_digests import DigestState
from hicache.transfer.base import TransferError

# Below glibc's non-temporal memcpy threshold on the machines measured: a copy this
# size leaves its destination (and source) in the cache for the hash that follows.
PIECE_BYTES = 256 * 2**10


class DigestingCopier:
    """Page copies between a CPU device pool and the host pool that checksum the host page."""

    def __init__(self, host: HostPool, device: DevicePool, piece_bytes: int = PIECE_BYTES) -> None:
        if device.device.type != "cpu":
            raise TransferError(f"digesting copies need a CPU device pool, not {device.device}")
        if host.geometry != device.geometry or host.page_size != device.page_size:
            raise TransferError("host and device pools do not match")
        if piece_bytes < 1:
            raise TransferError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.host = host
        self.device = device
        self.digests = host.digests
        geometry = host.geometry
        elem = geometry.element_bytes
        row_bytes = geometry.row_elems * elem
        hs, ds = host.strides, device.strides
        self._host_page_bytes = hs.page * elem
        self._device_page_bytes = ds.page * elem
        self._host_bytes = host.flat.view(torch.uint8).numpy()
        self._device_bytes = device.flat.view(torch.uint8).numpy()
        self._token_major = hs.token != geometry.row_elems
        if ds.token != geometry.row_elems:
            raise TransferError("the device pool must keep a page's rows of a layer together")
        # token-major: per piece, its tokens and (offset, size) in the host page's bytes.
        self._token_runs: list[tuple[int, int]] = []
        self._host_spans: list[tuple[int, int]] = []
        # layer-major: a page on either side viewed as [layers, planes, run bytes] (one
        # run is a (layer, plane)'s rows of the page); per piece, its part of that view.
        run_bytes = host.page_size * row_bytes
        self._run_shape = (geometry.num_layers, geometry.kv_planes, run_bytes)
        self._host_run_strides = (hs.layer * elem, hs.kv * elem, 1)
        self._device_run_strides = (ds.layer * elem, ds.kv * elem, 1)
        self._pieces: list[tuple[slice, slice, slice]] = []
        if self._token_major:
            token_bytes = hs.token * elem
            per_piece = max(1, piece_bytes // token_bytes)
            for t0 in range(0, host.page_size, per_piece):
                t1 = min(host.page_size, t0 + per_piece)
                self._token_runs.append((t0, t1))
                self._host_spans.append((t0 * token_bytes, (t1 - t0) * token_bytes))
        else:
            self._pieces = _layer_major_pieces(self._run_shape, row_bytes, piece_bytes)
        self._staging = threading.local()

    def _stage(self, size: int) -> np.ndarray:
        """The first ``size`` bytes of this thread's staging buffer (a store and a load
        may run at once, on different threads)."""
        buffer: np.ndarray | None = getattr(self._staging, "buffer", None)
        if buffer is None or buffer.size < size:
            buffer = np.empty(size, dtype=np.uint8)
            self._staging.buffer = buffer
        return buffer[:size]

    # ------------------------------------------------------------------ L1 -> L2
    def store(self, device_pages: PageIds, host_pages: PageIds, checksum: bool = True) -> None:
        """Copy device pages into host pages; each host page's digest becomes KNOWN
        (UNKNOWN without ``checksum``: the same copy, nothing hashed)."""
        for device_page, host_page in zip(_ids(device_pages), _ids(host_pages), strict=True):
            digest = self._copy_page(host_page, device_page, to_device=False, hash_it=checksum)
            if checksum:
                self.digests.set_known(host_page, digest)
            else:
                self.digests.forget([host_page])

    # ------------------------------------------------------------------ L2 -> L1
    def load_verified(self, host_pages: PageIds, device_pages: PageIds) -> int:
        """Copy host pages into device pages, checking every EXPECTED page against its
        digest as it goes; returns how many leading pages were copied and are good.

        Stops at the first page that fails (its device page holds garbage then); a page
        that passes becomes KNOWN. Other pages are copied without a check.
        """
        digests = self.digests
        for i, (host_page, device_page) in enumerate(
            zip(_ids(host_pages), _ids(device_pages), strict=True)
        ):
            if digests.state(host_page) is not DigestState.EXPECTED:
                self._copy_page(host_page, device_page, to_device=True, hash_it=False)
                continue
            digest = self._copy_page(host_page, device_page, to_device=True)
            if digest != digests.digest(host_page):
                return i
            digests.set_known(host_page, digest)
        return len(host_pages)

    # ------------------------------------------------------------------ internals
    def _copy_page(
        self, host_page: int, device_page: int, *, to_device: bool, hash_it: bool = True
    ) -> bytes:
        """Copy one page piece by piece, hashing each host piece right after its copy."""
        hasher = xxhash.xxh3_128()
        update: Callable[[Any], None] = hasher.update if hash_it else _skip
        host_base = host_page * self._host_page_bytes
        if self._token_major:
            host_view, device_view = self.host.pages[host_page], self.device.pages[device_page]
            for (t0, t1), (offset, size) in zip(self._token_runs, self._host_spans, strict=True):
                if to_device:
                    device_view[:, :, t0:t1].copy_(host_view[:, :, t0:t1])
                else:
                    host_view[:, :, t0:t1].copy_(device_view[:, :, t0:t1])
                start = host_base + offset
                update(self._host_bytes[start : start + size])
            return hasher.digest()
        # np.ndarray over a buffer checks the view stays inside it.
        host = np.ndarray(
            self._run_shape, np.uint8, self._host_bytes, host_base, self._host_run_strides
        )
        device = np.ndarray(
            self._run_shape, np.uint8, self._device_bytes,
            device_page * self._device_page_bytes, self._device_run_strides,
        )
        if not hash_it:  # nothing to keep in cache for: the page in one copy
            if to_device:
                device[...] = host
            else:
                host[...] = device
            return hasher.digest()
        for piece in self._pieces:
            h, d = host[piece], device[piece]
            source, target = (h, d) if to_device else (d, h)
            if h.flags.c_contiguous:
                target[...] = source
                update(h)
                continue
            # The host's runs of this piece lie apart (layer_first): gathered into this
            # thread's staging buffer, hashed there in one call (payload order: layer, then
            # plane), copied on. Hashing each run where it lies cost a GIL hand-off a run
            # (60 a page for SmolLM2) against the scheduler thread's.
            stage = self._stage(h.size).reshape(h.shape)
            stage[...] = source
            update(stage)
            target[...] = stage
        return hasher.digest()


def _layer_major_pieces(
    run_shape: tuple[int, int, int], row_bytes: int, piece_bytes: int
) -> list[tuple[slice, slice, slice]]:
    """Pieces of a [layers, planes, run bytes] page view, in payload order, each at
    most ``piece_bytes`` (or one row): whole layers where a layer's runs fit, else
    single runs, else parts of a run cut at row boundaries."""
    layers, planes, run_bytes = run_shape
    whole = slice(0, run_bytes)
    if planes * run_bytes <= piece_bytes:
        per_piece = piece_bytes // (planes * run_bytes)
        return [
            (slice(l0, min(layers, l0 + per_piece)), slice(0, planes), whole)
            for l0 in range(0, layers, per_piece)
        ]
    rows = max(1, piece_bytes // row_bytes) * row_bytes
    return [
        (slice(layer, layer + 1), slice(plane, plane + 1), slice(b0, min(run_bytes, b0 + rows)))
        for layer in range(layers)
        for plane in range(planes)
        for b0 in range(0, run_bytes, rows)
    ]


def _ids(pages: PageIds | torch.Tensor) -> list[int]:
    if isinstance(pages, torch.Tensor):
        return [int(page) for page in pages.tolist()]
    return [int(page) for page in np.asarray(pages).tolist()]


def _skip(_: Any) -> None:
    return None
