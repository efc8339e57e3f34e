"""SwiGLU feed-forward block with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from hicache.model.parameter import WeightViews, empty_parameter


class SwiGLU(nn.Module):
    """The weights of ``down(silu(gate(x)) * up(x))`` (computed in ``layer_blocks``).

    ``gate_up_weight`` stacks gate_proj over up_proj ([2 * intermediate, hidden]):
    one GEMM instead of two reads the activations once and launches once.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_weight = empty_parameter(
            2 * intermediate_size, hidden_size, device=device, dtype=dtype
        )
        self.down_weight = empty_parameter(
            hidden_size, intermediate_size, device=device, dtype=dtype
        )

    def hf_weights(self, prefix: str) -> WeightViews:
        n = self.intermediate_size
        return {
            f"{prefix}.gate_proj.weight": self.gate_up_weight.narrow(0, 0, n),
            f"{prefix}.up_proj.weight": self.gate_up_weight.narrow(0, n, n),
            f"{prefix}.down_proj.weight": self.down_weight,
        }
