"""A DeepSeek-V2/V3 decoder layer: MLA attention over the cached latent, then a dense
SwiGLU (the first ``first_k_dense_replace`` layers) or the MoE FFN."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.distributed.sharding import RankShard
from hicache.model.config import ModelConfig
from hicache.model.layer_blocks import feed_forward
from hicache.model.linear import linear
from hicache.model.mla_attention import MLAttention
from hicache.model.mla_step import MLAStep
from hicache.model.mlp import SwiGLU
from hicache.model.moe import MoE
from hicache.model.norm import RMSNorm, rms_norm
from hicache.model.parameter import WeightShards


@dataclass(frozen=True)
class MLAStepInputs:
    """What every MLA layer of one forward step shares."""

    cos: torch.Tensor  # [T, 1, rope_dim / 2] (YaRN-scaled)
    sin: torch.Tensor  # [T, 1, rope_dim / 2]
    out_slots: torch.Tensor  # [T]: pool slots of the new tokens' latent rows
    plan: MLAStep


class DeepseekLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        device: torch.device,
        dtype: torch.dtype,
        shard: RankShard,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        assert config.moe is not None
        eps = config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.self_attn = MLAttention(config, device, dtype, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.mlp: MoE | SwiGLU = (
            MoE(config.hidden_size, config.moe, device, dtype, shard)
            if config.moe.is_moe_layer(layer)
            else SwiGLU(config.hidden_size, config.intermediate_size, device, dtype,
                        shard.intermediate)
        )

    def forward(self, x: torch.Tensor, step: MLAStepInputs, cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new tokens' latent rows into ``cache``
        (one layer of the pool, [slots, 1, latent_dim])."""
        attn, norm = self.self_attn, self.input_layernorm
        q, rows = attn.project(rms_norm(x, norm.weight, norm.eps), step.cos, step.sin)
        # The pool holds the rotated rows: a cached prefix is reused without re-rotating.
        cache.view(cache.shape[0], -1).index_copy_(0, step.out_slots, rows)
        out = step.plan.attend(q, cache, attn.kv_b_weight, attn.mla)  # [T, heads, v]
        # Row-parallel o_proj and FFN: rank 0 alone adds the residual, the sum over the
        # ranks (a no-op for one) completes each.
        first = self.tp.rank == 0
        h = linear(out.reshape(out.shape[0], -1), attn.o_weight)
        h = self.tp.all_reduce_sum(h.add_(x) if first else h)
        post = self.post_attention_layernorm
        if isinstance(self.mlp, MoE):
            ffn = self.mlp(rms_norm(h, post.weight, post.eps))
            return self.tp.all_reduce_sum(ffn.add_(h) if first else ffn)
        mlp = self.mlp
        return self.tp.all_reduce_sum(feed_forward(
            h, h if first else None, post.weight, mlp.gate_up_weight, mlp.down_weight, post.eps
        ))

    def hf_shards(self, prefix: str) -> WeightShards:
        return {
            **self.input_layernorm.hf_shards(f"{prefix}.input_layernorm"),
            **self.self_attn.hf_shards(f"{prefix}.self_attn"),
            **self.post_attention_layernorm.hf_shards(f"{prefix}.post_attention_layernorm"),
            **self.mlp.hf_shards(f"{prefix}.mlp"),
        }
