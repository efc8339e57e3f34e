"""The reference attention backend: each context's K/V gathered out of the pool, then SDPA.

Correct on every device and simple to read, so the other backends are tested
against it; it copies every context per layer per step, which the paged
backends (``cpu``, ``triton``, ``flashinfer``) avoid by reading K/V in place.

An ``AttentionPlan`` is built once per forward step from the batch's host-side
lengths and shared by every layer. It sorts the sequences into three kinds,
each attended the cheapest way torch's ``scaled_dot_product_attention`` allows:

- cold (no context in the pool yet): causal attention over the step's own fresh
  K/V, ``is_causal=True``: the flash kernel on GPU, exactly as a plain prefill;
- with context (a cached prefix or earlier chunks, and more than one new token):
  K/V of the whole context gathered from the pool, causal with the new tokens
  aligned to the end of the context (query i sees context positions <= prefix + i);
- decode (one new token): all of them in one padded call, keys past each
  sequence's length masked out; no Python loop over sequences.

Every layer must have written the step's new K/V into the pool before calling
``attend``: the context and decode kinds read them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from hicache.attention.backend import AttentionBackend, AttentionStep
from hicache.attention.sdpa import causal_attention
from hicache.model.batch import ForwardBatch


@dataclass(frozen=True)
class _Segment:
    """One sequence attended on its own: new tokens [token_start, token_end)."""

    token_start: int
    token_end: int
    # None for a cold sequence; else the slots of its whole context [context_len].
    context_slots: torch.Tensor | None
    # For a sequence with context: which context positions each new token sees.
    # CausalBias on CUDA (lower-right causal, never materialized), else a bool
    # mask [extend_len, context_len].
    mask: torch.Tensor | CausalBias | None


@dataclass(frozen=True)
class _DecodeGroup:
    """All single-token sequences, attended together over padded contexts."""

    token_index: torch.Tensor | None  # [B]: their tokens in the batch; None = all tokens, in order
    slots: torch.Tensor  # [B, L] pool slots of each context, padded by repeating the last one
    key_mask: torch.Tensor  # [B, 1, 1, L] bool: True where the key is part of the context


class GatherBackend(AttentionBackend):
    name = "gather"

    def prepare(self, batch: ForwardBatch) -> AttentionPlan:
        return AttentionPlan.build(batch)


@dataclass(frozen=True)
class AttentionPlan(AttentionStep):
    num_tokens: int
    segments: tuple[_Segment, ...]
    decode: _DecodeGroup | None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        return attend(q, k, v, k_cache, v_cache, self)

    @classmethod
    def build(cls, batch: ForwardBatch) -> AttentionPlan:
        device = batch.context_slots.device
        segments: list[_Segment] = []
        decode_seqs: list[int] = []
        for i, (t0, c0) in enumerate(zip(batch.token_starts, batch.context_starts, strict=True)):
            extend, total = batch.extend_lens[i], batch.seq_lens[i]
            if extend == 1:
                decode_seqs.append(i)
            elif extend == total:
                segments.append(_Segment(t0, t0 + extend, None, None))
            else:
                slots = batch.context_slots[c0 : c0 + total]
                segments.append(
                    _Segment(t0, t0 + extend, slots, _context_mask(extend, total, device))
                )
        decode = _decode_group(batch, decode_seqs) if decode_seqs else None
        return cls(batch.num_tokens, tuple(segments), decode)


def _context_mask(extend: int, total: int, device: torch.device) -> torch.Tensor | CausalBias:
    if device.type == "cuda":
        return causal_lower_right(extend, total)
    prefix = total - extend
    query_pos = torch.arange(prefix, total, device=device)
    key_pos = torch.arange(total, device=device)
    return key_pos[None, :] <= query_pos[:, None]  # [extend, total]


def _decode_group(batch: ForwardBatch, seqs: list[int]) -> _DecodeGroup:
    device = batch.context_slots.device
    token_starts, context_starts = batch.token_starts, batch.context_starts
    lens_list = [batch.seq_lens[i] for i in seqs]
    # Only the B lengths and starts cross from the host; the [B, L] index and mask are
    # built on the device, so a big decode batch costs the host O(B), not O(B * L).
    lens = torch.tensor(lens_list, device=device)
    starts = torch.tensor([context_starts[i] for i in seqs], device=device)
    keys = torch.arange(max(lens_list), device=device)
    # Padding repeats each context's last slot: a real, finite K/V row, masked out anyway.
    index = starts[:, None] + torch.minimum(keys[None, :], lens[:, None] - 1)  # [B, L]
    key_mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    everything = len(seqs) == batch.num_seqs  # then token b is sequence b's only token
    token_index = (
        None if everything else torch.tensor([token_starts[i] for i in seqs], device=device)
    )
    return _DecodeGroup(
        token_index=token_index, slots=batch.context_slots[index], key_mask=key_mask
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Attention output [T, heads, head_dim] of the new tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], the new tokens' (also
    already written to the pool); k_cache, v_cache: one layer of the pool
    [num_slots, kv_heads, head_dim].
    """
    only = plan.segments[0] if len(plan.segments) == 1 and plan.decode is None else None
    if only is not None and only.context_slots is None:
        return causal_attention(q, k, v)  # one cold prefill: no copy into an output buffer
    if plan.decode is not None and plan.decode.token_index is None:
        return _decode(q, k_cache, v_cache, plan.decode)  # pure decode batch
    out = torch.empty_like(q)
    for seg in plan.segments:
        rows = slice(seg.token_start, seg.token_end)
        if seg.context_slots is None:
            out[rows] = causal_attention(q[rows], k[rows], v[rows])
        else:
            assert seg.mask is not None
            out[rows] = _with_context(q[rows], k_cache, v_cache, seg.context_slots, seg.mask)
    if plan.decode is not None:
        index = plan.decode.token_index
        assert index is not None
        out.index_copy_(0, index, _decode(q[index], k_cache, v_cache, plan.decode))
    return out


def _with_context(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | CausalBias,
) -> torch.Tensor:
    groups = q.shape[1] // k_cache.shape[1]
    # Context K/V, gathered once: [L, kv_heads, D] -> [1, heads, L, D]. Heads are repeated
    # rather than left to enable_gqa: the lower-right causal kernels take equal head counts.
    k_ctx = _heads_first(k_cache[slots], groups)
    v_ctx = _heads_first(v_cache[slots], groups)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_ctx, v_ctx, attn_mask=mask)
    return out[0].transpose(0, 1)


def _heads_first(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """[L, kv_heads, D] -> [1, kv_heads * groups, L, D], each KV head repeated for its group."""
    heads_first = kv.transpose(0, 1)
    if groups > 1:
        heads_first = heads_first.repeat_interleave(groups, dim=0)  # also makes it contiguous
    return heads_first[None]


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    # The query heads sharing a KV head become that head's query rows, so K/V keep
    # their kv_heads and need no repeating: q [B, kv_heads, groups, D].
    q_rows = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k_ctx = k_cache[group.slots].transpose(1, 2)  # [B, kv_heads, L, D]
    v_ctx = v_cache[group.slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q_rows, k_ctx, v_ctx, attn_mask=group.key_mask)
    return out.reshape(num_seqs, num_heads, head_dim)
