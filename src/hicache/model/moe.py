"""DeepSeek's mixture-of-experts FFN: shared experts every token uses, plus k routed ones.

Experts are SwiGLU blocks; the routed ones' weights are stacked
(``gate_up_weight`` [experts, 2 * intermediate, hidden], ``down_weight``
[experts, hidden, intermediate]). A step's (token, expert) pairs are sorted by
expert, so each expert multiplies all of its tokens in one GEMM: the Python loop
runs over experts, never over tokens.

Tensor parallelism: every expert's intermediate columns are split over the ranks
(gate/up column-parallel, down row-parallel), shared experts alike, and the router
is replicated: every rank routes each token the same way and computes its columns of
every chosen expert; the model sums the ranks' outputs. (Whole experts per rank,
expert parallelism, is not implemented.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.distributed.sharding import RankShard, ShardingError, Span, even_span
from hicache.model.deepseek_config import MoEShape, RoutingMethod
from hicache.model.layer_blocks import swiglu
from hicache.model.linear import linear
from hicache.model.mlp import SwiGLU
from hicache.model.moe_routing import route
from hicache.model.parameter import WeightShards, empty_parameter, part, whole


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe: MoEShape,
        device: torch.device,
        dtype: torch.dtype,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.hidden_size = hidden_size
        rank, size = (shard.rank, shard.size) if shard else (0, 1)
        full = moe.moe_intermediate_size
        if full < size:
            raise ShardingError(f"tp size {size} exceeds moe_intermediate_size ({full})")
        self.columns: Span = even_span(full, rank, size)
        n, experts = self.columns.size, moe.num_routed_experts
        # The router stays float32 whatever the model dtype (as the checkpoints keep it).
        self.gate_weight = empty_parameter(experts, hidden_size, device=device, dtype=torch.float32)
        self.score_bias = (
            empty_parameter(experts, device=device, dtype=torch.float32)
            if moe.routing is RoutingMethod.NOAUX_TC
            else None
        )
        self.gate_up_weight = empty_parameter(
            experts, 2 * n, hidden_size, device=device, dtype=dtype
        )
        self.down_weight = empty_parameter(experts, hidden_size, n, device=device, dtype=dtype)
        self.shared: SwiGLU | None = None
        if moe.num_shared_experts:
            shared = moe.shared_intermediate_size
            self.shared = SwiGLU(hidden_size, shared, device, dtype, even_span(shared, rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]: this rank's part of the FFN output."""
        k = self.moe.num_experts_per_tok
        logits = F.linear(x.float(), self.gate_weight)  # [T, experts]
        weights, experts = route(logits, self.moe, self.score_bias)  # [T, k] each
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert
        tokens = order // k  # [T * k]: the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.moe.num_routed_experts).tolist()
        rows = x[tokens]  # [T * k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate_up = linear(rows[start:end], self.gate_up_weight[expert])
            out[start:end] = linear(swiglu(gate_up), self.down_weight[expert])
            start = end
        # Weighted in float32 (the router's precision), rounded once, as the reference does.
        weighted = (out.float() * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        result = torch.zeros_like(x).index_add_(0, tokens, weighted)
        if self.shared is not None:
            gate_up = linear(x, self.shared.gate_up_weight)
            result += linear(swiglu(gate_up), self.shared.down_weight)
        return result

    def hf_shards(self, prefix: str) -> WeightShards:
        n, hidden, at = self.columns.size, self.hidden_size, self.columns.start
        full = self.moe.moe_intermediate_size
        shards: WeightShards = {f"{prefix}.gate.weight": whole(self.gate_weight)}
        if self.score_bias is not None:
            shards[f"{prefix}.gate.e_score_correction_bias"] = whole(self.score_bias)
        for e in range(self.moe.num_routed_experts):
            name = f"{prefix}.experts.{e}"
            gate_up, down = self.gate_up_weight[e], self.down_weight[e]
            shards[f"{name}.gate_proj.weight"] = part(gate_up[:n], (full, hidden), 0, at)
            shards[f"{name}.up_proj.weight"] = part(gate_up[n:], (full, hidden), 0, at)
            shards[f"{name}.down_proj.weight"] = part(down, (hidden, full), 1, at)
        if self.shared is not None:
            shards.update(self.shared.hf_shards(f"{prefix}.shared_experts"))
        return shards
