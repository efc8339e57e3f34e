"""Self-attention layer: fused q/k/v projection, optional qk-norm, RoPE, paged KV write and read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hicache.model.attention_backend import AttentionStep
from hicache.model.config import ModelConfig
from hicache.model.norm import RMSNorm
from hicache.model.parameter import WeightViews, empty_parameter


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
    """

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
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

    def hf_weights(self, prefix: str) -> WeightViews:
        q, kv = self.q_size, self.kv_size
        views: WeightViews = {
            f"{prefix}.q_proj.weight": self.qkv_weight.narrow(0, 0, q),
            f"{prefix}.k_proj.weight": self.qkv_weight.narrow(0, q, kv),
            f"{prefix}.v_proj.weight": self.qkv_weight.narrow(0, q + kv, kv),
            f"{prefix}.o_proj.weight": self.o_weight,
        }
        if self.qkv_bias is not None:
            views[f"{prefix}.q_proj.bias"] = self.qkv_bias.narrow(0, 0, q)
            views[f"{prefix}.k_proj.bias"] = self.qkv_bias.narrow(0, q, kv)
            views[f"{prefix}.v_proj.bias"] = self.qkv_bias.narrow(0, q + kv, kv)
        if self.o_bias is not None:
            views[f"{prefix}.o_proj.bias"] = self.o_bias
        if self.q_norm is not None and self.k_norm is not None:
            views.update(self.q_norm.hf_weights(f"{prefix}.q_norm"))
            views.update(self.k_norm.hf_weights(f"{prefix}.k_norm"))
        return views
