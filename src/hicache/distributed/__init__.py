"""Tensor parallelism: the ranks' process group (``group``) and how a model is split (``sharding``).

A rank's model is ``CausalLM(config, device, tp=init_tp_group(rank, size, ...))``; its
KV pool has the geometry ``config.kv_geometry(tp_rank=rank, tp_size=size)``.
"""

from __future__ import annotations

from hicache.distributed.group import SINGLE_RANK, TPGroup, default_backend, init_tp_group
from hicache.distributed.sharding import (
    RankShard,
    ShardingError,
    Span,
    even_span,
    kv_head_span,
    query_head_span,
    shard_model,
    shard_plan,
)

__all__ = [
    "SINGLE_RANK",
    "RankShard",
    "ShardingError",
    "Span",
    "TPGroup",
    "default_backend",
    "even_span",
    "init_tp_group",
    "kv_head_span",
    "query_head_span",
    "shard_model",
    "shard_plan",
]
