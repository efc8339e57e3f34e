"""Tensor-parallel start-up: every rank's build ends in an agreed "ready or failed".

A rank that fails while building its part (its weights, its pools, its L3 store) must
not leave the others waiting in their next collective until the group's timeout, nor
let them start serving without it. So ``build_engine`` runs in phases with no
collective inside them, and every rank, failed or not, ends each phase in
``agree_start``: one ``all_gather_object`` of every rank's outcome (its failure, if
any, and what the ranks must agree on, such as its pool sizes). When any rank failed,
every rank raises ``RankStartError`` naming the ranks that failed and why; rank 0's
message is what ``EngineClient.start()`` (and ``hicache serve``) report.

Alone (one rank) nothing is gathered: a failure raises as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hicache.distributed.group import TPGroup

T = TypeVar("T")


class RankStartError(RuntimeError):
    """A rank of the tensor-parallel group could not start; the message names it."""


@dataclass(frozen=True)
class RankOutcome(Generic[T]):
    """One rank's end of a start-up phase: its failure (None: it is ready) and its share
    of what the ranks agree on (None when it failed)."""

    rank: int
    error: str | None
    share: T | None


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def run_phase(
    tp: TPGroup, phase: Callable[[], T], share: Callable[[T], Any],
    discard: Callable[[T], None] | None = None,
) -> tuple[T, list[Any]]:
    """Run this rank's ``phase`` (no collective inside), then agree: every rank's
    ``share(result)``, in rank order, or ``RankStartError`` on every rank when any
    rank's phase raised (``discard(result)`` then releases what this rank built).
    Alone: ``phase()`` and ``[share(result)]``, its errors as they are.
    """
    if tp.size == 1:
        result = phase()
        return result, [share(result)]
    cause: Exception | None = None
    try:
        result = phase()
    except Exception as error:  # every rank hears of it in the agreement below
        cause = error
    if cause is None:
        mine: RankOutcome[Any] = RankOutcome(tp.rank, None, share(result))
    else:
        mine = RankOutcome(tp.rank, describe(cause), None)
    try:
        shares = agree_start(tp, mine)
    except RankStartError as failure:
        if cause is None and discard is not None:
            discard(result)
        raise failure from cause
    return result, shares


def agree_start(tp: TPGroup, mine: RankOutcome[Any]) -> list[Any]:
    """Every rank's share, in rank order; raises ``RankStartError`` (on every rank) when
    any rank failed. Every rank must call it, failed or not."""
    outcomes: list[RankOutcome[Any]] = tp.all_gather_object(mine)
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        raise RankStartError(failure_message(failed))
    return [o.share for o in outcomes]


def failure_message(failed: list[RankOutcome[Any]]) -> str:
    """The failed ranks by reason: ranks that failed alike (the same flags, the same
    model) are named together."""
    by_reason: dict[str, list[int]] = {}
    for outcome in failed:
        assert outcome.error is not None
        by_reason.setdefault(outcome.error, []).append(outcome.rank)
    parts = []
    for reason, ranks in by_reason.items():
        names = ", ".join(str(r) for r in ranks)
        noun = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"tensor-parallel {noun} {names} could not start: {reason}")
    return "; ".join(parts)
