"""Page layouts as strides over one flat buffer.

Every pool, whatever its layout, stores for each (page, layer, plane, token-in-page)
one contiguous row of ``kv_heads * head_dim`` elements; the planes of a layer are
K and V (MHA/GQA, ``kv_planes`` = 2) or the one latent (MLA, ``kv_planes`` = 1).
A layout is therefore fully described by four element strides. Viewing any pool
through ``canonical_view`` gives the same logical 5-D tensor

    [num_pages, num_layers, kv_planes (k|v, or the latent), page_size, row_elems]

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
    """Element strides of one row (token's K, V or latent in a layer) inside a flat buffer.

    ``kv`` steps from one plane to the next (K to V); with one plane it is never used.
    """

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
    planes = geometry.kv_planes
    if layout is MemLayout.LAYER_FIRST:
        # [layers][planes][num_pages * page_size][row]
        slots = num_pages * page_size
        return PageStrides(
            page=page_size * row, layer=planes * slots * row, kv=slots * row, token=row,
            page_contiguous=(layers == 1 and planes == 1) or (layers == 1 and num_pages == 1),
        )
    if layout is MemLayout.PAGE_FIRST:
        # [num_pages][page_size][layers][planes][row]
        return PageStrides(
            page=page_size * layers * planes * row, layer=planes * row, kv=row,
            token=layers * planes * row, page_contiguous=True,
        )
    if layout is MemLayout.PAGE_FIRST_DIRECT:
        # [num_pages][layers][planes][page_size][row]
        return PageStrides(
            page=layers * planes * page_size * row, layer=planes * page_size * row,
            kv=page_size * row, token=row, page_contiguous=True,
        )
    raise ValueError(f"unknown layout {layout!r}")


def canonical_view(
    flat: torch.Tensor, strides: PageStrides, geometry: KVGeometry, num_pages: int, page_size: int
) -> torch.Tensor:
    """View ``flat`` (1-D, the pool's whole buffer) as [pages, layers, planes, page_size, row]."""
    if flat.dim() != 1:
        raise ValueError("canonical_view expects the pool's flat 1-D buffer")
    return torch.as_strided(
        flat,
        size=(num_pages, geometry.num_layers, geometry.kv_planes, page_size, geometry.row_elems),
        stride=(strides.page, strides.layer, strides.kv, strides.token, 1),
    )
