"""SwiGLU feed-forward block with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from hicache.distributed.sharding import Span
from hicache.model.parameter import WeightShards, empty_parameter, part


class SwiGLU(nn.Module):
    """The weights of ``down(silu(gate(x)) * up(x))`` (computed in ``layer_blocks``).

    ``gate_up_weight`` stacks gate_proj over up_proj ([2 * intermediate, hidden]):
    one GEMM instead of two reads the activations once and launches once.

    Under tensor parallelism the block holds the intermediate columns ``columns``
    only: gate and up column-parallel, down row-parallel (the model sums the ranks'
    products). Elementwise silu(gate) * up needs nothing from other ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        device: torch.device,
        dtype: torch.dtype,
        columns: Span | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.columns = columns or Span(0, intermediate_size)
        self.intermediate_size = self.columns.size
        self.gate_up_weight = empty_parameter(
            2 * self.intermediate_size, hidden_size, device=device, dtype=dtype
        )
        self.down_weight = empty_parameter(
            hidden_size, self.intermediate_size, device=device, dtype=dtype
        )

    def hf_shards(self, prefix: str) -> WeightShards:
        n, full, hidden = self.intermediate_size, self.full_intermediate_size, self.hidden_size
        at = self.columns.start
        w = self.gate_up_weight
        return {
            f"{prefix}.gate_proj.weight": part(w.narrow(0, 0, n), (full, hidden), 0, at),
            f"{prefix}.up_proj.weight": part(w.narrow(0, n, n), (full, hidden), 0, at),
            f"{prefix}.down_proj.weight": part(self.down_weight, (hidden, full), 1, at),
        }
