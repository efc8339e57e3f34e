"""Which routed experts each token uses, and with what weight: DeepSeek's routing rules.

A rule per ``RoutingMethod``, all computed in float32 from the router's logits
(the checkpoints keep the router in float32):

- greedy (V2): softmax over all experts, the top k.
- group_limited_greedy (V2): experts in ``n_group`` groups; a group's score is its
  best expert's; only the ``topk_group`` best groups compete for the top k.
- noaux_tc (V3): sigmoid scores; the choice adds the per-expert correction bias
  (learned for load balance, "auxiliary-loss-free"), groups rank by the sum of their
  two best biased scores; the weights are the unbiased scores of the chosen experts,
  normalized to sum 1 when ``norm_topk_prob``.

Every rule ends scaled by ``routed_scaling_factor``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.model.deepseek_config import MoEShape, RoutingMethod

# (weights [T, k] float32, experts [T, k] int64)
Routes = tuple[torch.Tensor, torch.Tensor]


def route(logits: torch.Tensor, moe: MoEShape, bias: torch.Tensor | None = None) -> Routes:
    """Router ``logits`` [T, experts] float32 -> each token's k experts and their weights.

    ``bias`` [experts]: V3's ``e_score_correction_bias`` (noaux_tc only).
    """
    weights, experts = _RULES[moe.routing](logits, moe, bias)
    return weights * moe.routed_scaling_factor, experts


def _greedy(logits: torch.Tensor, moe: MoEShape, bias: torch.Tensor | None) -> Routes:
    scores = logits.softmax(dim=-1)
    weights, experts = scores.topk(moe.num_experts_per_tok, dim=-1)
    return weights, experts


def _group_limited_greedy(
    logits: torch.Tensor, moe: MoEShape, bias: torch.Tensor | None
) -> Routes:
    scores = logits.softmax(dim=-1)
    group_scores = _grouped(scores, moe).amax(dim=-1)  # [T, groups]
    allowed = _expert_mask(group_scores, moe)
    weights, experts = scores.masked_fill(~allowed, 0.0).topk(moe.num_experts_per_tok, dim=-1)
    return weights, experts


def _noaux_tc(logits: torch.Tensor, moe: MoEShape, bias: torch.Tensor | None) -> Routes:
    if bias is None:
        raise ValueError("noaux_tc routing needs the e_score_correction_bias")
    scores = logits.sigmoid()
    biased = scores + bias.float()
    group_scores = _grouped(biased, moe).topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
    allowed = _expert_mask(group_scores, moe)
    experts = biased.masked_fill(~allowed, float("-inf")).topk(moe.num_experts_per_tok, dim=-1)[1]
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, experts


def _grouped(scores: torch.Tensor, moe: MoEShape) -> torch.Tensor:
    """[T, experts] -> [T, groups, experts per group] (groups are contiguous expert ranges)."""
    return scores.view(scores.shape[0], moe.n_group, -1)


def _expert_mask(group_scores: torch.Tensor, moe: MoEShape) -> torch.Tensor:
    """[T, experts] bool: the experts of each token's ``topk_group`` best groups."""
    best = group_scores.topk(moe.topk_group, dim=-1)[1]
    groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    per_group = moe.num_routed_experts // moe.n_group
    return groups.repeat_interleave(per_group, dim=1)


_RULES: dict[RoutingMethod, Callable[[torch.Tensor, MoEShape, torch.Tensor | None], Routes]] = {
    RoutingMethod.GREEDY: _greedy,
    RoutingMethod.GROUP_LIMITED_GREEDY: _group_limited_greedy,
    RoutingMethod.NOAUX_TC: _noaux_tc,
}
