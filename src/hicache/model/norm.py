"""RMSNorm, computed in float32 whatever the model dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.kernels import cpu_layer_ops
from hicache.model.parameter import WeightShards, empty_parameter, whole


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` over the last dimension.

    The normalization runs in float32 and is rounded to the model dtype before
    the weight multiplies it: in bf16, normalizing in bf16 would lose the small
    differences between hidden states that the checkpoint was trained to see.
    """

    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def hf_shards(self, prefix: str) -> WeightShards:
        return {f"{prefix}.weight": whole(self.weight)}  # every rank holds it whole


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward as a function of its weight (what compiled layer blocks call)."""
    fused = cpu_layer_ops.rms_norm(x, weight, eps)  # float32 rows on the CPU: one pass
    if fused is not None:
        return fused
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)
