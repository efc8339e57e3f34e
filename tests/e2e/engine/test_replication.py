"""Replicated schedulers under tensor parallelism (2 ranks, gloo over loopback): every
rank applies rank 0's tick inputs and only the agreed (minimum) progress, so a rank whose
L2 copies land late holds the group back instead of letting the ranks' trees diverge,
and the outputs are the single-rank engine's.

Each rank drives its engine by hand (``tp_engine_ranks``): cold requests together, a
repeat from L1, one from L2 after the device cache is evicted, one after a flush.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache.config import CacheConfig
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.engine.replication import Progress, agree
from tests.ranks import run_ranks
from tests.tp_engine_ranks import (
    RankResult,
    Scenario,
    Step,
    greedy,
    prompt,
    run_scenario,
)

VOCAB = 500  # below the tiny preset's vocabulary
CONFIG = EngineConfig(
    model=ModelLoadConfig(preset="tiny", device="cpu", dtype="float32"),
    scheduling=SchedulingConfig(max_total_tokens=512),
    cache=CacheConfig(page_size=4, enable_hierarchical_cache=True),
)
TP2 = dataclasses.replace(CONFIG, parallel=ParallelConfig(tp_size=2))
LAG_TICKS = 12
UNSEEDED = "unseeded"


def _request(rid: str, seed: int, length: int, sampling: SamplingParams | None = None
             ) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt(seed, length, VOCAB), sampling=sampling or greedy(),
                           rid=rid)


def _steps() -> tuple[Step, ...]:
    sampled = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    unseeded = dataclasses.replace(sampled, seed=None)  # rank 0 draws its seed for all
    return (
        Step((_request("a", 1, 23), _request("b", 2, 17), _request("s", 3, 9, sampled),
              _request(UNSEEDED, 5, 12, unseeded))),
        Step((_request("a-l1", 1, 23), _request("c", 4, 30)), op_after="evict_device_cache"),
        Step((_request("a-l2", 1, 23),), op_after="flush"),
        Step((_request("a-cold", 1, 23),)),
    )


@pytest.fixture(scope="module")
def alone() -> RankResult:
    return run_scenario(SINGLE_RANK, Scenario(CONFIG, _steps()))


@pytest.mark.parametrize("lagging_rank", [None, 0, 1])
def test_ranks_agree_and_match_one_rank(alone: RankResult, lagging_rank: int | None) -> None:
    scenario = Scenario(TP2, _steps(), lagging_rank=lagging_rank, lag_ticks=LAG_TICKS)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    # Every rank drew the same tokens, even where no seed was given.
    assert follower.tokens == leader.tokens
    # The outputs and what came from which tier are the single-rank engine's.
    assert len(leader.tokens[UNSEEDED]) == 6
    seeded = {rid: tokens for rid, tokens in leader.tokens.items() if rid != UNSEEDED}
    assert seeded == {rid: tokens for rid, tokens in alone.tokens.items() if rid != UNSEEDED}
    assert leader.cached == alone.cached
    assert leader.cached["a-l1"][0] > 0 and leader.cached["a-l2"][1] > 0
    assert leader.cached["a-cold"] == (0, 0)
    # Both ranks went through the same ticks, agreed the same values, built the same tree.
    assert leader.num_ticks == follower.num_ticks > LAG_TICKS
    assert leader.agreed == follower.agreed
    assert leader.unacknowledged == follower.unacknowledged
    assert max(leader.unacknowledged) > 0  # there were copies to agree on
    assert leader.tree_device_pages == follower.tree_device_pages
    assert leader.tree_host_pages == follower.tree_host_pages
    assert leader.num_free_device_pages == follower.num_free_device_pages
    assert leader.num_free_host_pages == follower.num_free_host_pages
    for rank in (leader, follower):  # nobody acknowledged more than every rank had landed
        assert all(agreed <= seen for agreed, seen in zip(rank.agreed, rank.observed, strict=True))
    if lagging_rank is not None:
        lagging, other = (leader, follower) if lagging_rank == 0 else (follower, leader)
        assert all(a == 0 for a in lagging.agreed[:LAG_TICKS])
        # The fault mattered: the other rank had copies landed that the group did not take.
        assert any(seen > 0 for seen in other.observed[:LAG_TICKS])


def _agree_min(tp: TPGroup, value: int) -> list[int]:
    mine = value if tp.rank == 0 else value + 5
    return [agree(tp, Progress(mine)).num_landed_writes, agree(tp, Progress(3 - tp.rank))
            .num_landed_writes]


def test_agreement_is_the_minimum_on_every_rank() -> None:
    results = run_ranks(_agree_min, 2, 7)
    assert results == [[7, 2], [7, 2]]
    assert Progress.from_tensor(Progress(9).to_tensor()) == Progress(9)
    assert Progress(4).to_tensor().dtype == torch.int64
