"""Triton kernel that copies pages between two paged KV buffers described by strides.

Importing this module imports Triton; ``hicache.transfer.kernel`` does so lazily.

Either buffer may be pinned host memory: the GPU reads and writes it directly
over PCIe (zero-copy, unified virtual addressing). The pinned CPU tensor is
passed to the kernel as-is: Triton's CUDA launcher turns any argument with
``data_ptr()`` into a device address with ``cuPointerGetAttribute
(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, which succeeds for page-locked
memory (so no assumption that host and device addresses coincide) and fails
with "cpu tensor?" for pageable memory, a clear error instead of a GPU fault.
Passing the address as an int64 and casting it in the kernel would skip both.

Buffers are reinterpreted as integer "units" of up to 8 bytes (the caller picks
the widest unit that divides every stride and the row), so the copy is bitwise
and, with 16-byte aligned rows, each thread moves 16 bytes per access.
"""

# Kernel parameters stay unannotated on purpose: Triton reads annotations as
# types (``int`` would force 32-bit strides), so only constexprs are annotated.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import torch
import triton
import triton.language as tl

Strides = tuple[int, int, int, int]  # page, layer, kv, token (in units)

# Work per loop iteration of one program: enough bytes in flight per program to
# cover PCIe latency with a few hundred programs resident, small enough to keep
# registers low (16 KiB over 4 warps = 8 x 16-byte accesses per thread).
_TILE_BYTES = 16 * 1024
_NUM_WARPS = 4


@triton.jit(do_not_specialize=["first_layer"])
def _copy_pages_kernel(
    src,
    dst,
    src_pages,  # int64 [n], on the device
    dst_pages,  # int64 [n], on the device
    first_layer,
    src_page_stride,
    src_layer_stride,
    src_kv_stride,
    src_token_stride,
    dst_page_stride,
    dst_layer_stride,
    dst_kv_stride,
    dst_token_stride,
    PAGE_SIZE: tl.constexpr,
    KV_PLANES: tl.constexpr,  # 2 (K and V) or 1 (MLA latent)
    ROW: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    EVEN: tl.constexpr,  # ROW == BLOCK_ROW and BLOCK_TOKENS divides PAGE_SIZE: no masks
):
    # One program per (page-list entry, layer, plane): PAGE_SIZE rows of ROW units,
    # each row contiguous on both sides; rows are token_stride apart.
    entry = tl.program_id(0)
    layer_kv = tl.program_id(1)
    # 64-bit offsets throughout: a host pool easily exceeds 2**31 elements.
    layer = (first_layer + layer_kv // KV_PLANES).to(tl.int64)
    kv = (layer_kv % KV_PLANES).to(tl.int64)
    src_page = tl.load(src_pages + entry)
    dst_page = tl.load(dst_pages + entry)
    src_base = (
        src + src_page * src_page_stride + layer * src_layer_stride + kv * src_kv_stride
    )
    dst_base = (
        dst + dst_page * dst_page_stride + layer * dst_layer_stride + kv * dst_kv_stride
    )
    tokens = tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    cols = tl.arange(0, BLOCK_ROW)
    for first_token in tl.range(0, PAGE_SIZE, BLOCK_TOKENS):
        token = first_token + tokens
        src_ptrs = src_base + token[:, None] * src_token_stride + cols[None, :]
        dst_ptrs = dst_base + token[:, None] * dst_token_stride + cols[None, :]
        if EVEN:
            tl.store(dst_ptrs, tl.load(src_ptrs))
        else:
            mask = (token[:, None] < PAGE_SIZE) & (cols[None, :] < ROW)
            tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["first_layer"])
def _copy_pages_token_major_kernel(
    src,
    dst,
    src_pages,  # int64 [n], on the device
    dst_pages,  # int64 [n], on the device
    first_layer,
    src_page_stride,
    src_layer_stride,
    src_kv_stride,
    src_token_stride,
    dst_page_stride,
    dst_layer_stride,
    dst_kv_stride,
    dst_token_stride,
    NUM_LAYER_KV: tl.constexpr,  # planes x layers copied
    KV_PLANES: tl.constexpr,  # 2 (K and V) or 1 (MLA latent)
    ROW: tl.constexpr,
    BLOCK_LAYER_KV: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    EVEN: tl.constexpr,  # ROW == BLOCK_ROW and BLOCK_LAYER_KV divides NUM_LAYER_KV: no masks
):
    # One program per (page-list entry, token): NUM_LAYER_KV rows of ROW units.
    # For a token-major layout (page_first: [page][token][layer][plane][row]) these
    # rows are one contiguous span of the host buffer, so each tile reads or
    # writes contiguous host memory over PCIe instead of rows a layer apart.
    entry = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    src_page = tl.load(src_pages + entry)
    dst_page = tl.load(dst_pages + entry)
    src_base = src + src_page * src_page_stride + token * src_token_stride
    dst_base = dst + dst_page * dst_page_stride + token * dst_token_stride
    lkv = tl.arange(0, BLOCK_LAYER_KV).to(tl.int64)
    cols = tl.arange(0, BLOCK_ROW)
    for first in tl.range(0, NUM_LAYER_KV, BLOCK_LAYER_KV):
        index = first + lkv
        layer = first_layer + index // KV_PLANES
        kv = index % KV_PLANES
        src_rows = layer * src_layer_stride + kv * src_kv_stride
        dst_rows = layer * dst_layer_stride + kv * dst_kv_stride
        src_ptrs = src_base + src_rows[:, None] + cols[None, :]
        dst_ptrs = dst_base + dst_rows[:, None] + cols[None, :]
        if EVEN:
            tl.store(dst_ptrs, tl.load(src_ptrs))
        else:
            mask = (index[:, None] < NUM_LAYER_KV) & (cols[None, :] < ROW)
            tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


def copy_pages(
    src: torch.Tensor,
    src_strides: Strides,
    dst: torch.Tensor,
    dst_strides: Strides,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    first_layer: int,
    num_layers: int,
    page_size: int,
    row: int,
    token_major: bool = False,
    kv_planes: int = 2,
) -> None:
    """Copy layers [first_layer, first_layer + num_layers) of src_pages[i] to dst_pages[i].

    ``src``/``dst`` are flat unit buffers; strides, ``row`` in units. Enqueued on
    the current stream of the current device; returns without waiting.
    ``token_major`` gives each program one token's rows of every copied layer
    (for page_first host pools) instead of one (layer, plane)'s rows of every token.
    ``kv_planes``: rows per (token, layer), 2 for K and V, 1 for an MLA latent.
    """
    unit_bytes = src.element_size()
    block_row = triton.next_power_of_2(row)
    tile_units = _TILE_BYTES // unit_bytes
    if token_major:
        num_layer_kv = kv_planes * num_layers
        block_lkv = min(triton.next_power_of_2(num_layer_kv), max(1, tile_units // block_row))
        even_lkv = block_row == row and num_layer_kv % block_lkv == 0
        _copy_pages_token_major_kernel[(src_pages.numel(), page_size)](
            src, dst, src_pages, dst_pages, first_layer, *src_strides, *dst_strides,
            NUM_LAYER_KV=num_layer_kv, KV_PLANES=kv_planes, ROW=row, BLOCK_LAYER_KV=block_lkv,
            BLOCK_ROW=block_row,
            EVEN=even_lkv, num_warps=_NUM_WARPS,
        )
        return
    block_tokens = min(triton.next_power_of_2(page_size), max(1, tile_units // block_row))
    even = block_row == row and page_size % block_tokens == 0
    grid = (src_pages.numel(), kv_planes * num_layers)
    _copy_pages_kernel[grid](
        src, dst, src_pages, dst_pages, first_layer, *src_strides, *dst_strides,
        PAGE_SIZE=page_size, KV_PLANES=kv_planes, ROW=row, BLOCK_TOKENS=block_tokens,
        BLOCK_ROW=block_row,
        EVEN=even, num_warps=_NUM_WARPS,
    )
