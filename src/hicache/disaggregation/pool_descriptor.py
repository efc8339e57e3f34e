"""Where a device pool's pages lie in memory, in bytes: what a peer needs to write them.

The pool is one flat buffer (``memory/layout.py``): for each page, each layer and
each KV plane (K and V, or MLA's one latent), the page's ``page_size`` rows are one
contiguous chunk. A chunk's address is
``base + page * page_stride + layer * layer_stride + plane * kv_stride``; the decode side
sends this descriptor and its page ids, and the prefill side computes both ends'
addresses, merging runs of consecutive pages into one chunk each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.memory.device_pool import DevicePool


class IncompatiblePoolError(ValueError):
    """The two instances' pools hold different KV shapes (model, page size or dtype)."""


@dataclass(frozen=True)
class PoolDescriptor:
    base_address: int
    num_pages: int
    num_layers: int
    kv_planes: int  # 2: K and V; 1: an MLA latent
    page_stride_bytes: int
    layer_stride_bytes: int
    kv_stride_bytes: int
    # One page's rows of one layer's plane: page_size * row bytes, contiguous.
    chunk_bytes: int
    geometry: str  # KVGeometry.describe() and the page size, to refuse a foreign pool

    @classmethod
    def of(cls, pool: DevicePool) -> PoolDescriptor:
        strides = pool.strides
        element = pool.geometry.element_bytes
        if strides.token != pool.geometry.row_elems:
            raise ValueError("a page's rows must be contiguous within a layer to be sent")
        return cls(
            base_address=pool.flat.data_ptr(), num_pages=pool.num_pages,
            num_layers=pool.geometry.num_layers, kv_planes=pool.geometry.kv_planes,
            page_stride_bytes=strides.page * element, layer_stride_bytes=strides.layer * element,
            kv_stride_bytes=strides.kv * element,
            chunk_bytes=pool.page_size * pool.geometry.row_elems * element,
            geometry=f"{pool.geometry.describe()}-P{pool.page_size}",
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PoolDescriptor:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def check_compatible(self, other: PoolDescriptor) -> None:
        if self.geometry != other.geometry:
            raise IncompatiblePoolError(
                f"KV pools differ: this instance's is {self.geometry}, the peer's "
                f"{other.geometry} (serve the same model with the same --page-size)"
            )

    def check_pages(self, pages: PageIds) -> None:
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"page ids outside the peer pool's {self.num_pages} pages")


@dataclass(frozen=True)
class TransferPlan:
    """Chunks to copy: source address, destination address, length (bytes), aligned."""

    sources: list[int]
    destinations: list[int]
    lengths: list[int]

    @property
    def num_bytes(self) -> int:
        return sum(self.lengths)


def transfer_plan(
    source: PoolDescriptor, source_pages: PageIds,
    destination: PoolDescriptor, destination_pages: PageIds,
) -> TransferPlan:
    """Chunks that copy ``source_pages`` of one pool onto ``destination_pages`` of another,
    page i onto page i, every layer and plane."""
    source.check_compatible(destination)
    if len(source_pages) != len(destination_pages):
        raise ValueError(
            f"{len(source_pages)} source pages for {len(destination_pages)} destination pages"
        )
    source.check_pages(source_pages)
    destination.check_pages(destination_pages)
    src = np.asarray(source_pages, np.int64)
    dst = np.asarray(destination_pages, np.int64)
    mergeable = source.page_stride_bytes == source.chunk_bytes \
        and destination.page_stride_bytes == destination.chunk_bytes
    runs = _runs(src, dst) if mergeable else [
        (int(s), int(d), 1) for s, d in zip(src, dst, strict=True)
    ]
    plan = TransferPlan([], [], [])
    for layer in range(source.num_layers):
        for kv in range(source.kv_planes):
            src_base = source.base_address + layer * source.layer_stride_bytes \
                + kv * source.kv_stride_bytes
            dst_base = destination.base_address + layer * destination.layer_stride_bytes \
                + kv * destination.kv_stride_bytes
            for src_page, dst_page, count in runs:
                plan.sources.append(src_base + src_page * source.page_stride_bytes)
                plan.destinations.append(dst_base + dst_page * destination.page_stride_bytes)
                plan.lengths.append(count * source.chunk_bytes)
    return plan


def _runs(source: PageIds, destination: PageIds) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, length) of each run where both sides'
    pages go up by one: adjacent pages of one layer are adjacent in a layer-first pool."""
    if len(source) == 0:
        return []
    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(destination) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(source)]])
    return [
        (int(source[s]), int(destination[s]), int(e - s))
        for s, e in zip(starts, ends, strict=True)
    ]
