"""How a model is split over tensor-parallel ranks: the heads, MLP columns and vocabulary
rows each rank holds. Pure arithmetic: no tensors, no process group.

Every part a rank holds is one contiguous ``Span``; where a count does not divide by
the number of ranks, the first ``count % size`` ranks hold one more (``even_span``).

Attention is split by whole GQA groups, because every attention backend computes a
rank's heads as uniform groups (query head h reads KV head ``h // (heads / kv_heads)``):
a rank must hold, with each query head, the KV head it reads, and the same number of
query heads for each of its KV heads. With ``g = num_heads / num_kv_heads``:

- ``num_kv_heads >= size``: the KV heads are split (``even_span``), never replicated,
  and each rank holds the query heads of its KV heads' groups: KV heads [a, b) bring
  query heads [a * g, b * g). No divisibility is required: with 3 KV heads over 2 ranks
  rank 0 holds 2 groups and rank 1 one, so attention is uneven (2:1) while the MLP and
  the vocabulary are split evenly.
- ``num_kv_heads < size``: each KV head is REPLICATED on ``size / num_kv_heads`` ranks
  (this requires ``size % num_kv_heads == 0``): rank r keeps KV head
  ``r * num_kv_heads // size``, and that head's group of g query heads is split
  (``even_span``) among its replicas; every rank needs a query head, so
  ``num_heads >= size``.
- Anything else raises ``ShardingError`` naming the numbers.

SmolLM2-135M (9 query heads, 3 KV heads, groups of 3), tp=2: rank 0 holds KV heads
{0, 1} and query heads 0-5, rank 1 KV head {2} and query heads 6-8; intermediate
1536 -> 768 + 768; vocabulary 49152 -> 24576 + 24576. Query heads are neither padded
nor split unevenly inside a group: the row-parallel output projection sums the
ranks' partial products whatever their widths.

The MLP's intermediate columns and the vocabulary rows are split by ``even_span``
(row-parallel down projection, vocab-parallel embedding and LM head).

Ranks may hold different numbers of KV heads (SmolLM2 at tp=2: 2 and 1), so their KV
bytes per token differ: the ranks' pools must agree on a number of pages (sized for
the rank with the most KV heads, ``shard_plan``), not each derive it from its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.config import ConfigError

if TYPE_CHECKING:
    from hicache.model.config import ModelConfig


class ShardingError(ConfigError):
    """A model that cannot be split over the asked number of ranks; the message says why."""


@dataclass(frozen=True)
class Span:
    """The contiguous range [start, stop) of some count (heads, columns, rows)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid span [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> Span:
        """The same range in units ``factor`` times smaller (heads -> rows of head_dim)."""
        return Span(self.start * factor, self.stop * factor)

    def shifted(self, offset: int) -> Span:
        return Span(self.start + offset, self.stop + offset)


def even_span(total: int, rank: int, size: int) -> Span:
    """Rank ``rank``'s part of range(total) cut into ``size`` contiguous parts whose sizes
    differ by at most one, the larger ones first."""
    _check_rank(rank, size)
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return Span(start, start + base + (1 if rank < extra else 0))


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise ShardingError unless the attention heads can be split over ``size`` ranks."""
    if size < 1:
        raise ShardingError(f"tp size must be at least 1, got {size}")
    if num_kv_heads >= size:
        return
    if size % num_kv_heads:
        raise ShardingError(
            f"tp size {size} does not fit {num_kv_heads} KV heads: with fewer KV heads than "
            f"ranks each KV head is replicated, so the tp size must be a multiple of "
            f"{num_kv_heads} (or at most {num_kv_heads})"
        )
    if num_heads < size:
        raise ShardingError(
            f"tp size {size} exceeds the model's {num_heads} query heads: every rank needs one"
        )


def kv_head_span(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Span:
    """The KV heads rank ``rank`` holds (one replicated head when there are fewer than ranks)."""
    check_heads(num_heads, num_kv_heads, size)
    if num_kv_heads >= size:
        return even_span(num_kv_heads, rank, size)
    _check_rank(rank, size)
    head = rank * num_kv_heads // size
    return Span(head, head + 1)


def query_head_span(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Span:
    """The query heads rank ``rank`` holds: its KV heads' groups, or its part of the group
    of its replicated KV head."""
    kv = kv_head_span(num_heads, num_kv_heads, rank, size)
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        return kv.scaled(group)
    replicas = size // num_kv_heads
    return even_span(group, rank % replicas, replicas).shifted(kv.start * group)


@dataclass(frozen=True)
class RankShard:
    """What one tensor-parallel rank holds of a model (all spans are of the full model)."""

    rank: int
    size: int
    query_heads: Span
    kv_heads: Span
    intermediate: Span  # columns of the MLP (rows of gate and up, columns of down)
    vocab: Span  # rows of the embedding and of the LM head
    vocab_sizes: tuple[int, ...]  # every rank's vocab rows, in rank order (logits' gather)

    @property
    def num_heads(self) -> int:
        return self.query_heads.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.size


def shard_model(config: ModelConfig, rank: int, size: int) -> RankShard:
    """Rank ``rank``'s part of ``config``'s model split over ``size`` ranks."""
    _check_rank(rank, size)
    for name, count in (("intermediate_size", config.intermediate_size),
                        ("vocab_size", config.vocab_size)):
        if count < size:
            raise ShardingError(f"tp size {size} exceeds the model's {name} ({count})")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    return RankShard(
        rank=rank,
        size=size,
        query_heads=query_head_span(heads, kv_heads, rank, size),
        kv_heads=kv_head_span(heads, kv_heads, rank, size),
        intermediate=even_span(config.intermediate_size, rank, size),
        vocab=even_span(config.vocab_size, rank, size),
        vocab_sizes=tuple(even_span(config.vocab_size, r, size).size for r in range(size)),
    )


def shard_plan(config: ModelConfig, size: int) -> tuple[RankShard, ...]:
    """Every rank's shard, in rank order (e.g. to size pools by the largest rank's KV)."""
    return tuple(shard_model(config, rank, size) for rank in range(size))


def _check_rank(rank: int, size: int) -> None:
    if size < 1:
        raise ShardingError(f"tp size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ShardingError(f"tp rank {rank} is outside [0, {size})")
