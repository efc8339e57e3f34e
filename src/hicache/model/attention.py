"""Self-attention layer: fused q/k/v projection, optional qk-norm, RoPE, paged KV write and read.

This module holds the layer's weights (the math around attention is ``layer_blocks``');
attention over the paged pool is the step's backend's (``hicache.attention``), with every
kernel it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hicache.attention.backend import AttentionStep
from hicache.distributed.sharding import RankShard, Span
from hicache.model.config import ModelConfig
from hicache.model.norm import RMSNorm
from hicache.model.parameter import WeightShards, empty_parameter, part, whole


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward step shares (computed once per step)."""

    cos: torch.Tensor  # [T, 1, head_dim / 2]
    sin: torch.Tensor  # [T, 1, head_dim / 2]
    out_slots: torch.Tensor  # [T]: pool slots of the new tokens' K/V
    attention: AttentionStep


class Attention(nn.Module):
    """The weights of multi-head attention with grouped KV heads (GQA).

    ``qkv_weight`` stacks q_proj, k_proj and v_proj ([q_size + 2 * kv_size, hidden]):
    one GEMM for all three. The math is in ``layer_blocks`` (around attention) and
    the step's ``AttentionStep`` (attention over the paged pool).

    Under tensor parallelism (``shard``) the layer holds its rank's query and KV heads
    only: q/k/v are column-parallel (the rows of those heads), o_proj row-parallel
    (their columns; the model sums the ranks' products). ``o_bias`` is held whole by
    every rank and added by rank 0 only.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        # In rows of head_dim: where this rank's heads sit in the checkpoint's q, k and v.
        self.q_rows = shard.query_heads.scaled(head_dim) if shard else Span(0, config.q_size)
        self.kv_rows = shard.kv_heads.scaled(head_dim) if shard else Span(0, config.kv_size)
        self.full_q_size, self.full_kv_size = config.q_size, config.kv_size
        self.hidden_size = config.hidden_size
        self.num_heads = shard.num_heads if shard else config.num_heads
        self.num_kv_heads = shard.num_kv_heads if shard else config.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.q_rows.size, self.kv_rows.size
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_weight = empty_parameter(qkv_rows, config.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = (
            empty_parameter(qkv_rows, device=device, dtype=dtype) if config.qkv_bias else None
        )
        self.o_weight = empty_parameter(config.hidden_size, self.q_size, device=device, dtype=dtype)
        self.o_bias = (
            empty_parameter(config.hidden_size, device=device, dtype=dtype)
            if config.o_bias
            else None
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype)

    def hf_shards(self, prefix: str) -> WeightShards:
        q, kv, hidden = self.q_size, self.kv_size, self.hidden_size
        q_full, kv_full = self.full_q_size, self.full_kv_size
        q_at, kv_at = self.q_rows.start, self.kv_rows.start
        w = self.qkv_weight
        shards: WeightShards = {
            f"{prefix}.q_proj.weight": part(w.narrow(0, 0, q), (q_full, hidden), 0, q_at),
            f"{prefix}.k_proj.weight": part(w.narrow(0, q, kv), (kv_full, hidden), 0, kv_at),
            f"{prefix}.v_proj.weight": part(w.narrow(0, q + kv, kv), (kv_full, hidden), 0, kv_at),
            f"{prefix}.o_proj.weight": part(self.o_weight, (hidden, q_full), 1, q_at),
        }
        if self.qkv_bias is not None:
            b = self.qkv_bias
            shards[f"{prefix}.q_proj.bias"] = part(b.narrow(0, 0, q), (q_full,), 0, q_at)
            shards[f"{prefix}.k_proj.bias"] = part(b.narrow(0, q, kv), (kv_full,), 0, kv_at)
            shards[f"{prefix}.v_proj.bias"] = part(b.narrow(0, q + kv, kv), (kv_full,), 0, kv_at)
        if self.o_bias is not None:
            shards[f"{prefix}.o_proj.bias"] = whole(self.o_bias)
        if self.q_norm is not None and self.k_norm is not None:
            shards.update(self.q_norm.hf_shards(f"{prefix}.q_norm"))
            shards.update(self.k_norm.hf_shards(f"{prefix}.k_norm"))
        return shards
