"""The arithmetic of splitting a model over tensor-parallel ranks, checked exhaustively.

For every small (query heads, KV heads, tp size): either a ShardingError naming the
numbers, or spans such that the ranks' query heads partition the model's, each rank
holds the KV head of every query head it holds, with the uniform grouping the
attention backends compute (local head i reads local KV head i // local group), and
KV heads are replicated only when there are fewer than ranks.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from hicache.distributed.sharding import (
    ShardingError,
    Span,
    even_span,
    kv_head_span,
    query_head_span,
    shard_model,
    shard_plan,
)
from hicache.model.config import Architecture, ModelConfig
from hicache.model.presets import get_preset

# SmolLM2-135M-Instruct's shape.
SMOLLM2 = ModelConfig(
    architecture=Architecture.LLAMA,
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    dtype=torch.float32,
)


def _partition(spans: list[Span], total: int) -> bool:
    """The spans, in order, cover [0, total) contiguously."""
    return spans[0].start == 0 and spans[-1].stop == total and all(
        a.stop == b.start for a, b in itertools.pairwise(spans)
    )


@pytest.mark.parametrize("size", range(1, 9))
def test_even_span_partitions_evenly_larger_parts_first(size: int) -> None:
    for total in range(size, 60):
        spans = [even_span(total, rank, size) for rank in range(size)]
        sizes = [s.size for s in spans]
        assert _partition(spans, total)
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)


def _head_cases() -> list[tuple[int, int, int]]:
    return [
        (heads, kv, size)
        for kv in range(1, 9)
        for heads in range(kv, 33, kv)
        for size in range(1, 9)
    ]


def test_head_spans_exhaustively() -> None:
    refused = 0
    for heads, kv, size in _head_cases():
        group = heads // kv
        feasible = kv >= size or (size % kv == 0 and heads >= size)
        if not feasible:
            with pytest.raises(ShardingError, match=f"tp size {size}"):
                query_head_span(heads, kv, 0, size)
            refused += 1
            continue
        q_spans = [query_head_span(heads, kv, r, size) for r in range(size)]
        kv_spans = [kv_head_span(heads, kv, r, size) for r in range(size)]
        case = (heads, kv, size)
        assert _partition(q_spans, heads), case
        for q, k in zip(q_spans, kv_spans, strict=True):
            assert q.size >= 1 and k.size >= 1, case
            # Uniform local groups: local head i reads local KV head i // local_group,
            # which must be the model's KV head of that query head.
            assert q.size % k.size == 0, case
            local_group = q.size // k.size
            for i in range(q.size):
                assert (q.start + i) // group == k.start + i // local_group, case
        if kv >= size:
            assert _partition(kv_spans, kv), case  # split, never replicated
        else:
            assert all(k.size == 1 for k in kv_spans), case
            held = [k.start for k in kv_spans]
            assert all(held.count(h) == size // kv for h in range(kv)), case
    assert refused > 0  # the exhaustive range reaches the refusals


def test_smollm2_at_tp2_splits_by_gqa_groups() -> None:
    rank0, rank1 = shard_plan(SMOLLM2, 2)
    assert (rank0.query_heads, rank0.kv_heads) == (Span(0, 6), Span(0, 2))
    assert (rank1.query_heads, rank1.kv_heads) == (Span(6, 9), Span(2, 3))
    assert (rank0.intermediate, rank1.intermediate) == (Span(0, 768), Span(768, 1536))
    assert (rank0.vocab, rank1.vocab) == (Span(0, 24576), Span(24576, 49152))
    assert rank0.vocab_sizes == rank1.vocab_sizes == (24576, 24576)
    assert SMOLLM2.kv_geometry(tp_rank=0, tp_size=2).num_kv_heads == 2
    assert SMOLLM2.kv_geometry(tp_rank=1, tp_size=2).num_kv_heads == 1


def test_smollm2_at_tp3_one_group_each_and_tp6_replicates() -> None:
    plan3 = shard_plan(SMOLLM2, 3)
    assert [s.query_heads for s in plan3] == [Span(0, 3), Span(3, 6), Span(6, 9)]
    assert [s.kv_heads for s in plan3] == [Span(0, 1), Span(1, 2), Span(2, 3)]
    plan6 = shard_plan(SMOLLM2, 6)
    assert [s.kv_heads.start for s in plan6] == [0, 0, 1, 1, 2, 2]
    assert [s.query_heads.size for s in plan6] == [2, 1, 2, 1, 2, 1]


@pytest.mark.parametrize(
    ("heads", "kv", "size", "message"),
    [
        (9, 3, 4, "tp size 4 does not fit 3 KV heads"),
        (8, 2, 3, "multiple of 2"),
        (4, 1, 8, "exceeds the model's 4 query heads"),
    ],
)
def test_refusals_name_the_numbers(heads: int, kv: int, size: int, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        kv_head_span(heads, kv, 0, size)


def test_model_shard_checks_rank_and_counts() -> None:
    tiny = get_preset("tiny")
    with pytest.raises(ShardingError, match="outside"):
        shard_model(tiny, 2, 2)
    narrow = dataclasses.replace(tiny, intermediate_size=3)
    with pytest.raises(ShardingError, match="intermediate_size"):
        shard_model(narrow, 0, 4)
    whole = shard_model(tiny, 0, 1)
    assert (whole.num_heads, whole.num_kv_heads) == (tiny.num_heads, tiny.num_kv_heads)
    assert whole.vocab == Span(0, tiny.vocab_size)
    assert tiny.kv_geometry(tp_rank=0, tp_size=1) == tiny.kv_geometry()
