"""Triton kernels of paged attention: queries attend K/V read in place through a page table.

Importing this module imports Triton; ``hicache.attention.triton`` (the backend and
the launchers) does so only when a kernel is first called.

Every key, the step's new ones included, is read from the pool: key position n
of sequence b lives in slot ``page_table[b, n // PAGE_SIZE] * PAGE_SIZE +
n % PAGE_SIZE``. Entries of a page-table row past the sequence's pages are never
read (their loads are masked), so they may hold anything.

Softmax is online (flash attention): one pass over the keys keeps, per query
row, the running maximum ``m``, the running sum ``total`` of exponentials and the
unnormalized output ``acc``, all in fp32. Scores are kept in base 2 (the scale
is pre-multiplied by log2(e)), so the exponentials are ``exp2``. The running
maximum starts at a large finite negative number instead of -inf: a row whose
keys in one block are all masked then gets weights exp2(-inf - m) = 0 and a
rescale factor of 1, never the NaN of (-inf) - (-inf).

``DOT_MODE`` picks how the two products (Q K^T and P V) are computed:

- ``DOT_NATIVE``: Triton's default, tensor cores on fp16/bf16 operands;
- ``DOT_IEEE``: for fp32 caches, exact fp32 products (the default would round
  the operands to tf32, 10 mantissa bits);
- ``DOT_UPCAST``: the bf16 operands converted to fp32 first, then exact. Only for
  bf16 under the Triton interpreter, whose ``tl.dot`` multiplies the raw bits of
  bf16 operands (it stores bf16 as uint16 and documents bf16 arithmetic as
  unsupported). The operands are the same bf16 values (P is still rounded to
  bf16 first), so only the summation order differs from the GPU's.
"""

# Kernel parameters stay unannotated on purpose: Triton reads annotations as
# types (``int`` would force 32-bit strides), so only constexprs are annotated.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

DOT_NATIVE = 0
DOT_IEEE = 1
DOT_UPCAST = 2


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    # fp32 result; DOT_MODE is a constexpr, so only one branch is compiled.
    if DOT_MODE == 2:  # DOT_UPCAST
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT_MODE == 1:  # DOT_IEEE
        result = tl.dot(a, b, input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def _attend_block(
    q_tile,  # [ROWS, BLOCK_D] in the cache dtype
    k_cache,
    v_cache,
    table_row,  # pointer to this sequence's page-table row
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    n,  # [BLOCK_N] key positions of this block
    visible,  # [ROWS, BLOCK_N] (or [1, BLOCK_N]) bool: which keys each row attends
    n_ok,  # [BLOCK_N] bool: positions inside the context (the only ones loaded)
    d,
    d_ok,
    m,
    total,
    acc,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    """One block of keys folded into the online softmax state (m, total, acc) of ROWS query rows."""
    page = tl.load(table_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + n % PAGE_SIZE
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_cache + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=kv_mask, other=0.0,
    )
    s = _dot(q_tile, tl.trans(k), DOT_MODE) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
        mask=kv_mask, other=0.0,
    )
    # P in the cache dtype: half-precision tensor-core dot, fp32 accumulation.
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_MODE)
    return m_new, total, acc


@triton.jit
def decode_kernel(
    q,  # [B, heads, D]
    k_cache,  # [slots, kv_heads, D]
    v_cache,
    page_table,  # [B, max_pages]
    seq_lens,  # [B]
    out,  # [B, heads, D] (DIRECT) or unused
    part_out,  # [B, heads, num_splits, D] fp32 (split) or unused
    part_lse,  # [B, heads, num_splits] fp32, base 2 (split) or unused
    scale_log2,
    split_len,  # keys per split, a multiple of BLOCK_N
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP, >= 16 (tl.dot's smallest tile)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalized output, no reduction pass
    DOT_MODE: tl.constexpr,  # see the module docstring
):
    # One program per (sequence, KV head, split): the GROUP query heads sharing a
    # KV head are the rows of one tile, so each K/V block is loaded once for all
    # of them (GQA), and a split covers keys [split * split_len, + split_len).
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    start = split * split_len
    # The last split runs to the sequence's end: a host-side bound below a real
    # length then costs parallelism, never keys.
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + split_len, seq_len))

    h = tl.arange(0, BLOCK_H)
    h_ok = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = h_ok[:, None] & d_ok[None, :]
    q_tile = tl.load(
        q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=q_mask, other=0.0,
    )
    table_row = page_table + b.to(tl.int64) * stride_pt

    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite "-inf": see the module docstring
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        m, total, acc = _attend_block(
            q_tile, k_cache, v_cache, table_row, kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh,
            n, n_ok[None, :], n_ok, d, d_ok, m, total, acc, scale_log2,
            PAGE_SIZE, DOT_MODE,
        )

    # An empty split (past this sequence's end) has total == 0: output 0, weight exp2(-inf) = 0.
    nonempty = total > 0
    result = acc / tl.where(nonempty, total, 1.0)[:, None]
    if DIRECT:
        out_ptrs = out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=q_mask)
    else:
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out + row[:, None] * HEAD_DIM + d[None, :], result, mask=q_mask)
        lse = tl.where(nonempty, m + tl.math.log2(tl.where(nonempty, total, 1.0)), float("-inf"))
        tl.store(part_lse + row, lse, mask=h_ok)


@triton.jit
def decode_reduce_kernel(
    part_out,  # [B, heads, num_splits, D] fp32
    part_lse,  # [B, heads, num_splits] fp32, base 2
    out,  # [B, heads, D]
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
):
    # One program per (sequence, query head): the splits' partial outputs, each
    # normalized over its own keys, weighted by their share of the total sum,
    # exp2(lse_split) / sum exp2(lse), computed relative to the largest lse.
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (b.to(tl.int64) * num_heads + head) * num_splits + s
    lse = tl.load(part_lse + row, mask=s_ok, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: max is finite
    weight = weight / tl.sum(weight, 0)
    partial = tl.load(
        part_out + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    result = tl.sum(partial * weight[:, None], 0)
    out_ptrs = out + b.to(tl.int64) * stride_ob + head * stride_oh + d
    tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=d_ok)


@triton.jit
def extend_kernel(
    q,  # [T, heads, D]
    k_cache,  # [slots, kv_heads, D]
    v_cache,
    page_table,  # [B, max_pages]
    seq_lens,  # [B]
    qo_indptr,  # [B + 1]
    out,  # [T, heads, D]
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_MODE: tl.constexpr,  # see the module docstring
):
    # One program per (sequence, query head, block of BLOCK_M new tokens). New
    # token i of a sequence sits at position prefix + i (causal, aligned to the
    # end of the context) and attends keys 0..prefix + i, all read from the pool.
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    extend_len = tl.load(qo_indptr + b + 1) - q_start
    seq_len = tl.load(seq_lens + b)
    prefix = seq_len - extend_len
    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = i < extend_len
    q_pos = prefix + i
    # Keys this block's last row sees; none at all for a block past the sequence's
    # new tokens (the grid covers the longest extend), whose stores are all masked.
    first_row = m_block * BLOCK_M
    kv_end = tl.where(
        first_row < extend_len, prefix + tl.minimum(first_row + BLOCK_M, extend_len), 0
    )

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = i_ok[:, None] & d_ok[None, :]
    rows = (q_start + i).to(tl.int64)
    q_tile = tl.load(q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                     mask=q_mask, other=0.0)
    kv_head = head // GROUP
    table_row = page_table + b.to(tl.int64) * stride_pt

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        m, total, acc = _attend_block(
            q_tile, k_cache, v_cache, table_row, kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh,
            n, visible, n_ok, d, d_ok, m, total, acc, scale_log2,
            PAGE_SIZE, DOT_MODE,
        )

    # Rows past extend_len are masked out of the store; total > 0 for every real row
    # (it sees key 0), the guard only keeps the padding rows finite.
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptrs = out + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=q_mask)
