"""TPGroup's collectives between real processes (gloo over loopback), and size 1 for free."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hicache.distributed.group import SINGLE_RANK, TPGroup, default_backend, init_tp_group
from tests.collectives import exercise_collectives, fail_on_rank_one
from tests.ranks import run_ranks


def test_collectives_between_three_ranks() -> None:
    widths = (3, 1, 2)  # uneven, as the vocabulary of an odd-sized model
    results = run_ranks(exercise_collectives, 3, widths)
    expected_columns = [100 * r + c for r, w in enumerate(widths) for c in range(w)]
    for rank, got in enumerate(results):
        assert torch.equal(got["summed"], torch.full((2, 3), 6.0)), rank
        assert got["gathered"].tolist() == [expected_columns] * 2, rank
        assert got["equal"].tolist() == [[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]], rank
        assert got["obj"] == {"from": 0, "batch": [1, 2, 3]}, rank
        assert got["from_last"] == "rank 2", rank
        assert got["everyone"] == [{"rank": r, "word": "x" * r} for r in range(3)], rank


def test_a_failing_rank_fails_the_run_with_its_traceback() -> None:
    with pytest.raises(AssertionError, match="rank one fails on purpose"):
        run_ranks(fail_on_rank_one, 2)


def test_size_one_joins_nothing_and_returns_its_inputs() -> None:
    tp = init_tp_group(0, 1, "tcp://127.0.0.1:1")  # never contacted
    assert tp is SINGLE_RANK and tp.group is None
    assert not dist.is_initialized()
    t = torch.arange(4.0)
    assert tp.all_reduce_sum(t) is t
    assert tp.all_gather_last_dim(t) is t
    obj = object()
    assert tp.broadcast_object(obj) is obj
    assert tp.all_gather_object(obj) == [obj]


def test_group_invariants_and_backend_choice() -> None:
    with pytest.raises(ValueError, match="outside"):
        TPGroup(rank=2, size=2)
    with pytest.raises(ValueError, match="process group"):
        TPGroup(rank=0, size=2)  # no group: its collectives would silently do nothing
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda:1") == "nccl"
