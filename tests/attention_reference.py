"""Reference for the paged attention kernels, and random batches to check them on.

The reference is deliberately naive: one sequence at a time, its context
gathered from the pool through the page table, a full score matrix masked
causally (aligned to the end of the context), softmax and products in fp32.

A batch (``make_batch``) lives in a real ``DevicePool`` (its last layer, so the
K/V tensors are strided views into the middle of the pool's buffer) on shuffled
pages. Everything a kernel must never read is NaN: the pool's unused pages, the
slots past each sequence's end in its last page, and what the page table holds
past each sequence's pages (the id of an unused page). A kernel that reads any
of it, even only to mask the score afterwards, returns NaN (0 * NaN = NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Largest |kernel - reference| allowed (outputs are averages of N(0, 1) values, so
# |out| < ~3): fp32 products are exact up to summation order; half precision
# rounds q, K, V (inputs of both) the same way, and P to the cache dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor  # [T, heads, D]
    k_cache: torch.Tensor  # [slots, kv_heads, D]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B + 1] int32
    page_size: int
    max_extend_len: int

    def to(self, device: torch.device | str) -> PagedBatch:
        return PagedBatch(
            self.q.to(device), self.k_cache.to(device), self.v_cache.to(device),
            self.page_table.to(device), self.seq_lens.to(device), self.qo_indptr.to(device),
            self.page_size, self.max_extend_len,
        )


def make_batch(
    seq_lens: list[int],
    extend_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_pages: int = 3,
    extra_table_columns: int = 2,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Sequence b has ``seq_lens[b]`` tokens of context, the last ``extend_lens[b]`` new."""
    assert len(seq_lens) == len(extend_lens)
    assert all(1 <= e <= s for s, e in zip(seq_lens, extend_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-length // page_size) for length in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    geometry = KVGeometry(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    pool = DevicePool(geometry, num_pages, page_size, device)
    pool.flat.fill_(float("nan"))
    k_cache, v_cache = pool.k_buffer(1), pool.v_buffer(1)
    order = torch.randperm(num_pages, generator=gen)
    spare = order[sum(pages_per_seq):]
    width = max(pages_per_seq) + extra_table_columns
    page_table = torch.empty((len(seq_lens), width), dtype=torch.int32)
    context_slots = []
    used = 0
    for b, (length, count) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        pages = order[used : used + count]
        used += count
        page_table[b, :count] = pages
        # Past its pages: unused (NaN) pages, as a stale persistent table would hold.
        page_table[b, count:] = spare[torch.randint(len(spare), (width - count,), generator=gen)]
        context_slots.append(pool.slots(pages)[:length])
    # Random K/V in every context slot, drawn on the device (model-sized batches hold GBs).
    slots = torch.cat(context_slots).to(device)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    for cache in (k_cache, v_cache):
        values = torch.randn(len(slots), kv_heads, head_dim, generator=device_gen, device=device)
        cache[slots] = values.to(dtype)
    qo_indptr = torch.tensor([0, *torch.tensor(extend_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), heads, head_dim, generator=device_gen, device=device)
    return PagedBatch(
        q.to(dtype), k_cache, v_cache, page_table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), qo_indptr.to(device),
        page_size, max(extend_lens),
    )


def reference_attention(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:
    """fp32 output [T, heads, D] of every new token, computed on the batch's device."""
    q = batch.q.float()
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // batch.k_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.full_like(q, float("nan"))
    bounds = batch.qo_indptr.tolist()
    for b, length in enumerate(batch.seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        positions = torch.arange(length, device=q.device)
        pages = batch.page_table[b, positions // batch.page_size].long()
        slots = pages * batch.page_size + positions % batch.page_size
        keys = batch.k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, heads, D]
        values = batch.v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:end], keys) * scale
        query_positions = length - (end - start) + torch.arange(end - start, device=q.device)
        visible = positions[None, :] <= query_positions[:, None]  # [new, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), values)
    return out


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |out - expected|; NaN anywhere in out (a read of poisoned K/V) counts as inf."""
    diff = (out.detach().float() - expected.to(out.device)).abs().cpu()
    return math.inf if diff.isnan().any() else float(diff.max()) if diff.numel() else 0.0
