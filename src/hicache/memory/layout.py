"""Page layouts as strides over one flat buffer.

Every pool, whatever its layout, stores for each (page, layer, k|v, token-in-page)
one contiguous row of ``kv_heads * head_dim`` elements. A layout is therefore
fully described by four element strides. Viewing any pool through
``canonical_view`` gives the same logical 5-D tensor

    [num_pages, num_layers, 2 (k|v), page_size, row_elems]

so copies between layouts are plain indexing on dim 0, and a GPU kernel needs
only the strides to gather or scatter pages between any two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry


@dataclass(frozen=True)
class PageStrides:
    """Element strides of one row (token's K or V in a layer) inside a flat buffer."""

    page: int
    layer: int
    kv: int
    token: int
    # True when one page occupies one contiguous span of `page_elems` elements,
    # which lets a page be copied (or handed to L3) as a single object.
    page_contiguous: bool


def page_strides(
    layout: MemLayout, geometry: KVGeometry, num_pages: int, page_size: int
) -> PageStrides:
    row = geometry.row_elems
    layers = geometry.num_layers
    if layout is MemLayout.LAYER_FIRST:
        # [layers][2][num_pages * page_size][row]
        slots = num_pages * page_size
        return PageStrides(
            page=page_size * row, layer=2 * slots * row, kv=slots * row, token=row,
            page_contiguous=(layers == 1 and num_pages == 1),
        )
    if layout is MemLayout.PAGE_FIRST:
        # [num_pages][page_size][layers][2][row]
        return PageStrides(
            page=page_size * layers * 2 * row, layer=2 * row, kv=row, token=layers * 2 * row,
            page_contiguous=True,
        )
    if layout is MemLayout.PAGE_FIRST_DIRECT:
        # [num_pages][layers][2][page_size][row]
        return PageStrides(
            page=layers * 2 * page_size * row, layer=2 * page_size * row, kv=page_size * row,
            token=row, page_contiguous=True,
        )
    raise ValueError(f"unknown layout {layout!r}")


def canonical_view(
    flat: torch.Tensor, strides: PageStrides, geometry: KVGeometry, num_pages: int, page_size: int
) -> torch.Tensor:
    """View ``flat`` (1-D, the pool's whole buffer) as [pages, layers, 2, page_size, row]."""
    if flat.dim() != 1:
        raise ValueError("canonical_view expects the pool's flat 1-D buffer")
    return torch.as_strided(
        flat,
        size=(num_pages, geometry.num_layers, 2, page_size, geometry.row_elems),
        stride=(strides.page, strides.layer, strides.kv, strides.token, 1),
    )
