"""One forward step's MLA plan: which rows of the pool each sequence reads, and in which form.

Built once per step from the ``ForwardBatch`` (shared by every layer). The form
is chosen per sequence (``MLAForm``), by default by arithmetic cost
(``absorbed_is_cheaper``): decodes (one new token) always attend in the absorbed
form, all of a step's decodes in one batched call over their padded contexts; a
cold prompt always in the expanded form; a chunk over a long cached context in
whichever multiplies less. Tests force either form everywhere.
Every layer has written the step's new rows into the pool before attending, so
all rows are read from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from hicache.model.batch import ForwardBatch
from hicache.model.deepseek_config import MLAShape
from hicache.model.mla_attention import attend_absorbed, attend_expanded


class MLAForm(str, Enum):
    AUTO = "auto"  # per sequence, the cheaper (``absorbed_is_cheaper``)
    ABSORBED = "absorbed"
    EXPANDED = "expanded"


def absorbed_is_cheaper(num_new: int, context_len: int, mla: MLAShape) -> bool:
    """Whether ``num_new`` queries over ``context_len`` rows multiply less in the absorbed
    form. Per head, the expanded form decompresses every context row (latent x (nope + v))
    and attends with widths qk + v; the absorbed form moves every query into latent space
    and back (latent x (nope + v)) and attends with widths latent + rope and latent.
    On DeepSeek-V2-Lite's shapes this picks the faster form of each measured case
    (docs/benchmarks.md): decodes absorbed, cold prompts expanded, 64 new tokens over a
    2048-token context absorbed, 256 over 256 expanded."""
    rank = mla.kv_lora_rank
    per_row = rank * (mla.qk_nope_head_dim + mla.v_head_dim)
    expanded = context_len * (per_row + num_new * (mla.qk_head_dim + mla.v_head_dim))
    absorbed = num_new * (per_row + context_len * (2 * rank + mla.qk_rope_head_dim))
    return absorbed < expanded


@dataclass(frozen=True)
class _Group:
    """Sequences attended to in one call, padded to the longest: B sequences, E new tokens
    (E = 1 for batched decodes)."""

    rows: torch.Tensor | slice  # their rows in the step, [B * E] in order
    slots: torch.Tensor  # [B, L] int64: context slots (padding repeats a valid slot)
    num_new: int  # E
    # [B, E, L] bool; None: a cold prompt (E == L) in the expanded form, where SDPA
    # applies the causal mask itself (no [L, L] mask is built).
    mask: torch.Tensor | None
    absorbed: bool


class MLAStep:
    def __init__(
        self, batch: ForwardBatch, mla: MLAShape, form: MLAForm = MLAForm.AUTO
    ) -> None:
        device = batch.page_table.device
        pages = batch.sequence_pages.long()
        page_size = batch.page_size
        groups: list[_Group] = []
        decodes = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        if decodes and form is not MLAForm.EXPANDED:
            longest = max(batch.seq_lens[i] for i in decodes)
            pos = torch.arange(longest, device=device)
            index = torch.tensor(decodes, device=device)
            lens = batch.seq_lens_tensor[index].long()
            valid = pos[None, :] < lens[:, None]  # [D, L]
            slots = pages[index][:, pos // page_size] * page_size + pos % page_size
            # Table entries past a context's last page may hold anything: pad with a
            # real row (masked out) so the gather stays in the pool.
            slots = torch.where(valid, slots, slots[:, :1])
            rows = torch.tensor([batch.token_starts[i] for i in decodes], device=device)
            groups.append(_Group(rows, slots, 1, valid.unsqueeze(1), absorbed=True))
        else:
            decodes = []
        batched = set(decodes)
        for i, (start, extend) in enumerate(zip(batch.token_starts, batch.extend_lens,
                                                 strict=True)):
            if i in batched:
                continue
            total = batch.seq_lens[i]
            pos = torch.arange(total, device=device)
            slots = pages[i, pos // page_size] * page_size + pos % page_size
            absorbed = form is MLAForm.ABSORBED or (
                form is MLAForm.AUTO and absorbed_is_cheaper(extend, total, mla)
            )
            mask = None
            if absorbed or extend < total:
                # Lower-right causal: the new token at position p sees positions <= p.
                mask = (pos[None, :] <= pos[total - extend :, None]).unsqueeze(0)
            groups.append(_Group(
                slice(start, start + extend), slots.unsqueeze(0), extend, mask, absorbed
            ))
        self.groups = tuple(groups)

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, kv_b_weight: torch.Tensor, mla: MLAShape
    ) -> torch.Tensor:
        """q [T, heads, qk_head_dim], one layer of the pool [slots, 1, latent_dim] ->
        [T, heads, v_head_dim]."""
        table = cache.view(cache.shape[0], -1)  # [slots, latent_dim]
        out = q.new_empty(q.shape[0], q.shape[1], mla.v_head_dim)
        for group in self.groups:
            b, e = group.slots.shape[0], group.num_new
            group_q = q[group.rows].view(b, e, q.shape[1], q.shape[2])
            rows = table[group.slots]
            if group.absorbed:
                assert group.mask is not None
                result = attend_absorbed(group_q, rows, group.mask, kv_b_weight, mla)
            else:
                result = attend_expanded(group_q, rows, group.mask, kv_b_weight, mla)
            out[group.rows] = result.reshape(b * e, q.shape[1], mla.v_head_dim)
        return out
