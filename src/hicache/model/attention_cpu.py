"""The CPU attention backend: decode reads the paged pool in place, prompts use SDPA.

Decode rows (one new token) go to the C++ kernel of ``hicache.kernels.cpu_attention``,
which walks each context through its page table: nothing is copied, whatever the
contexts' lengths. Prompts with a context (a cached prefix, earlier chunks) gather
their context's K/V once per layer and run torch's SDPA with grouped KV heads: the
gather is small beside the attention of many queries. Cold prompts attend to their
own fresh K/V, causal.

Measured on this project's CPU machine against the reference (docs/benchmarks.md):
decode attention 2.5-3.6x faster (SmolLM2-135M heads, contexts 512-4096, batches 1-128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.kernels.cpu_attention import paged_decode
from hicache.model.attention_backend import AttentionBackend, AttentionStep
from hicache.model.attention_gather import SDPA_HAS_GQA, causal_attention
from hicache.model.batch import ForwardBatch


@dataclass(frozen=True)
class _Prompt:
    """A sequence with several new tokens: rows [start, end) of the step."""

    start: int
    end: int
    slots: torch.Tensor | None  # its whole context's slots; None: cold (no context)
    mask: torch.Tensor | None  # [extend, context] bool: lower-right causal


@dataclass(frozen=True)
class _Decodes:
    rows: torch.Tensor | None  # their rows in the step; None: every row, in order
    pages: torch.Tensor  # [D, pages] int32: their page-table rows
    lens: torch.Tensor  # [D] int32


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def prepare(self, batch: ForwardBatch) -> CpuPagedStep:
        return CpuPagedStep(batch)


class CpuPagedStep(AttentionStep):
    def __init__(self, batch: ForwardBatch) -> None:
        self.page_size = batch.page_size
        device = batch.page_table.device
        prompts: list[_Prompt] = []
        decode_seqs: list[int] = []
        for i, (start, extend) in enumerate(zip(batch.token_starts, batch.extend_lens,
                                                 strict=True)):
            total = batch.seq_lens[i]
            if extend == 1:
                decode_seqs.append(i)
            elif extend == total:
                prompts.append(_Prompt(start, start + extend, None, None))
            else:
                pos = torch.arange(total, device=device)
                row = batch.sequence_pages[i].long()
                slots = row[pos // batch.page_size] * batch.page_size + pos % batch.page_size
                mask = pos[None, :] <= pos[total - extend :, None]
                prompts.append(_Prompt(start, start + extend, slots, mask))
        self.prompts = tuple(prompts)
        self.decodes: _Decodes | None = None
        if decode_seqs:
            if len(decode_seqs) == batch.num_seqs:
                self.decodes = _Decodes(None, batch.sequence_pages, batch.seq_lens_tensor)
            else:
                index = torch.tensor(decode_seqs, device=device)
                starts = batch.token_starts
                rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
                self.decodes = _Decodes(
                    rows, batch.sequence_pages[index].contiguous(),
                    batch.seq_lens_tensor[index].contiguous(),
                )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        decodes = self.decodes
        if decodes is not None and decodes.rows is None:
            return self._decode(q, k_cache, v_cache, decodes)
        if decodes is None and len(self.prompts) == 1 and self.prompts[0].slots is None:
            return causal_attention(q, k, v)
        out = torch.empty_like(q)
        for prompt in self.prompts:
            rows = slice(prompt.start, prompt.end)
            if prompt.slots is None:
                out[rows] = causal_attention(q[rows], k[rows], v[rows])
            else:
                assert prompt.mask is not None
                out[rows] = _with_context(q[rows], k_cache, v_cache, prompt.slots, prompt.mask)
        if decodes is not None:
            assert decodes.rows is not None
            out.index_copy_(0, decodes.rows, self._decode(q[decodes.rows], k_cache, v_cache,
                                                          decodes))
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decodes: _Decodes
    ) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, decodes.pages, decodes.lens, self.page_size)


def _with_context(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    # [L, kv_heads, D] -> [1, kv_heads, L, D]; SDPA's enable_gqa maps query heads onto
    # their KV head without copying K/V once per query head.
    # index_select, not k_cache[slots]: the same rows, 5x faster for these shapes (it copies
    # whole rows where advanced indexing goes element by element).
    k_ctx = k_cache.index_select(0, slots).transpose(0, 1)[None]
    v_ctx = v_cache.index_select(0, slots).transpose(0, 1)[None]
    groups = q.shape[1] // k_cache.shape[1]
    if groups > 1 and not SDPA_HAS_GQA:
        k_ctx, v_ctx = k_ctx.repeat_interleave(groups, 1), v_ctx.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_ctx, v_ctx, attn_mask=mask,
        **({"enable_gqa": True} if groups > 1 and SDPA_HAS_GQA else {}),
    )
    return out[0].transpose(0, 1)
