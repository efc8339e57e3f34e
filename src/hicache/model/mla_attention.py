"""Multi-head latent attention (MLA, DeepSeek-V2/V3): weights, projections, and the two forms.

Per token the pool caches one row per layer, ``[c | k_rope]``: ``c`` the normed
latent (kv_lora_rank) and ``k_rope`` the rotated key part every head shares
(qk_rope_head_dim). Head h's key is ``[W_uk[h] c | k_rope]`` and its value
``W_uv[h] c``, where ``kv_b_proj`` stacks per head ``[W_uk[h]; W_uv[h]]``.

Two ways to attend over cached rows, the same numbers up to rounding:
- expanded: decompress every context row into per-head K_nope and V
  (``kv_b_proj``), then ordinary attention with head dims qk_head_dim / v_head_dim.
  Costs a [context, latent] x [latent, heads * (nope + v)] GEMM per step: cheap
  beside the attention of many new tokens (prefill, extend).
- absorbed: fold ``W_uk`` into the queries (``q_nope W_uk[h]`` lives in latent
  space) and ``W_uv`` after the softmax: attention is then one shared "head" of
  width kv_lora_rank + rope over the rows as cached (multi-query), with no
  per-context-token decompression. Cheaper when few queries read a long context
  (decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.distributed.sharding import RankShard, Span
from hicache.model.config import ModelConfig
from hicache.model.deepseek_config import MLAShape
from hicache.model.linear import linear
from hicache.model.norm import RMSNorm, rms_norm
from hicache.model.parameter import WeightShards, empty_parameter, part
from hicache.model.rotary import apply_rotary, apply_rotary_interleaved

# transformers' DeepSeek builds q_a_layernorm and kv_a_layernorm with the default eps,
# not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """The weights of one MLA layer; under tensor parallelism its rank's heads.

    Column-parallel by heads: q_proj / q_b_proj (rows of qk_head_dim per head) and
    kv_b_proj (rows of nope + v per head); row-parallel: o_proj (columns of v per
    head). Replicated: q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm:
    every rank computes, caches and holds the whole latent.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        assert config.mla is not None
        mla = self.mla = config.mla
        hidden = self.hidden_size = config.hidden_size
        self.full_num_heads = config.num_heads
        self.heads: Span = shard.query_heads if shard else Span(0, config.num_heads)
        self.num_heads = self.heads.size
        h = self.num_heads
        self.q_a_weight: nn.Parameter | None = None
        self.q_a_norm: RMSNorm | None = None
        if mla.q_lora_rank is None:
            self.q_weight = empty_parameter(h * mla.qk_head_dim, hidden, device=device, dtype=dtype)
        else:
            rank = mla.q_lora_rank
            self.q_a_weight = empty_parameter(rank, hidden, device=device, dtype=dtype)
            self.q_a_norm = RMSNorm(rank, LATENT_NORM_EPS, device, dtype)
            self.q_weight = empty_parameter(h * mla.qk_head_dim, rank, device=device, dtype=dtype)
        self.kv_a_weight = empty_parameter(mla.latent_dim, hidden, device=device, dtype=dtype)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, device, dtype)
        self.kv_b_weight = empty_parameter(
            h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank,
            device=device, dtype=dtype,
        )
        self.o_weight = empty_parameter(hidden, h * mla.v_head_dim, device=device, dtype=dtype)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (normed) -> q [T, heads, qk_head_dim], latent rows [T, latent_dim]
        (``[c | k_rope]``, as cached), rope applied to q's and k's rotary parts."""
        mla = self.mla
        if self.q_a_weight is not None and self.q_a_norm is not None:
            x_q = rms_norm(linear(x, self.q_a_weight), self.q_a_norm.weight, LATENT_NORM_EPS)
        else:
            x_q = x
        q = linear(x_q, self.q_weight).view(x.shape[0], self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        latent = linear(x, self.kv_a_weight)
        c, k_rope = latent.split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        q = torch.cat((q_nope, rotate(q_rope, cos, sin)), dim=-1)
        # k_rope [T, rope] rotated as one head: cos/sin are [T, 1, rope / 2].
        k_rope = rotate(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        rows = torch.cat((rms_norm(c, self.kv_a_norm.weight, LATENT_NORM_EPS), k_rope), dim=-1)
        return q, rows

    def hf_shards(self, prefix: str) -> WeightShards:
        mla, hidden, heads = self.mla, self.hidden_size, self.full_num_heads
        qk, kv_b = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        at = self.heads.start
        shards: WeightShards = {}
        if self.q_a_weight is not None and self.q_a_norm is not None:
            assert mla.q_lora_rank is not None
            shards[f"{prefix}.q_a_proj.weight"] = part(
                self.q_a_weight, (mla.q_lora_rank, hidden), 0, 0
            )
            shards.update(self.q_a_norm.hf_shards(f"{prefix}.q_a_layernorm"))
            shards[f"{prefix}.q_b_proj.weight"] = part(
                self.q_weight, (heads * qk, mla.q_lora_rank), 0, at * qk
            )
        else:
            shards[f"{prefix}.q_proj.weight"] = part(
                self.q_weight, (heads * qk, hidden), 0, at * qk
            )
        shards[f"{prefix}.kv_a_proj_with_mqa.weight"] = part(
            self.kv_a_weight, (mla.latent_dim, hidden), 0, 0
        )
        shards.update(self.kv_a_norm.hf_shards(f"{prefix}.kv_a_layernorm"))
        shards[f"{prefix}.kv_b_proj.weight"] = part(
            self.kv_b_weight, (heads * kv_b, mla.kv_lora_rank), 0, at * kv_b
        )
        shards[f"{prefix}.o_proj.weight"] = part(
            self.o_weight, (hidden, heads * mla.v_head_dim), 1, at * mla.v_head_dim
        )
        return shards


def attend_expanded(
    q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None, kv_b_weight: torch.Tensor,
    mla: MLAShape,
) -> torch.Tensor:
    """q [B, E, heads, qk_head_dim], context rows [B, L, latent_dim], mask [B, E, L] bool
    (True: may attend; None: causal, E == L) -> [B, E, heads, v_head_dim]."""
    b, length, heads = rows.shape[0], rows.shape[1], q.shape[2]
    c, k_rope = rows.split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
    kv = linear(c, kv_b_weight).view(b, length, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=-1)
    k = torch.cat((k_nope, k_rope.unsqueeze(2).expand(b, length, heads, -1)), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask.unsqueeze(1), is_causal=mask is None,
        scale=mla.softmax_scale,
    )  # [B, heads, E, v]
    return out.transpose(1, 2)


def attend_absorbed(
    q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, kv_b_weight: torch.Tensor,
    mla: MLAShape,
) -> torch.Tensor:
    """Same contract as ``attend_expanded``, computed in latent space."""
    b, e, heads = q.shape[0], q.shape[1], q.shape[2]
    rank = mla.kv_lora_rank
    w = kv_b_weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, rank)
    w_uk, w_uv = w.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=1)  # [H, nope|v, rank]
    q_nope, q_rope = q.split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
    # q_nope . (W_uk c) == (q_nope W_uk) . c: queries move into latent space.
    q_latent = torch.einsum("behn,hnr->behr", q_nope, w_uk)
    q_rows = torch.cat((q_latent, q_rope), dim=-1).reshape(b, 1, e * heads, -1)
    # Every head reads the same rows: one key/value "head" [B, 1, L, .], the value
    # being the latent part of each row.
    head_mask = mask.unsqueeze(2).expand(b, e, heads, -1).reshape(b, 1, e * heads, -1)
    out_latent = F.scaled_dot_product_attention(
        q_rows, rows.unsqueeze(1), rows[..., :rank].unsqueeze(1),
        attn_mask=head_mask, scale=mla.softmax_scale,
    ).view(b, e, heads, rank)
    return torch.einsum("behr,hvr->behv", out_latent, w_uv)
