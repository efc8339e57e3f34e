"""L3 under tensor parallelism (2 ranks, gloo over loopback; file backend): the ranks
agree on what each L3 lookup found and each read landed (the minimum over the ranks) in
the per-tick collective, so a prefix read back from L3 after a flush is the single-rank
engine's, and a rank whose store finds or returns fewer pages makes the prefix shorter
on every rank while the outputs stay the single-rank engine's; so does a rank whose
store answers its reads late: past the prefetch deadline (the requests go on with what
every rank has) or past the call deadline (a stalled call, whose host pages that rank
frees only once it returned, at the tick every rank frees them), and a rank whose
write stalls keeps the node it backs up protected on every rank until the call returned.
Under each of the three prefetch policies the ranks take the same prefix and the outputs
are alike.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hicache.cache.l3_agreement import NUM_SLOTS, L3Progress, SlotProgress
from hicache.config import CacheConfig
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.engine.api import GenerateRequest
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.engine.replication import Progress, agree
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.ranks import run_ranks
from tests.tp_engine_ranks import (
    L3Fault,
    RankResult,
    Scenario,
    Step,
    greedy,
    prompt,
    run_scenario,
)

VOCAB = 500  # below the tiny preset's vocabulary
PAGE_SIZE = 4
SHORT_PAGES = 2  # how many pages the faulty rank's store falls short by


def _config(path: Path, tp_size: int, **storage_options: object) -> EngineConfig:
    # wait_complete: a request starts once its prefetch has landed, so what L3 gives it
    # does not depend on timing (the deadline, 30 s, is never reached here).
    options = {"prefetch_policy": PrefetchPolicy.WAIT_COMPLETE, **storage_options}
    storage = StorageConfig(
        backend="file", prefetch_threshold=4, backend_extra={"path": str(path)},
        **options,  # type: ignore[arg-type]
    )
    return EngineConfig(
        model=ModelLoadConfig(preset="tiny", device="cpu", dtype="float32"),
        scheduling=SchedulingConfig(max_total_tokens=512),
        cache=CacheConfig(page_size=PAGE_SIZE, enable_hierarchical_cache=True),
        storage=storage,
        parallel=ParallelConfig(tp_size=tp_size),
    )


def _request(rid: str, seed: int, length: int) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt(seed, length, VOCAB), sampling=greedy(), rid=rid)


# Cold requests, a flush (L1 and L2 forget them, L3 keeps them), the same prompts again.
STEPS = (
    Step((_request("a", 1, 23), _request("b", 2, 30)), op_after="flush"),
    Step((_request("a-l3", 1, 23), _request("b-l3", 2, 30))),
)
FROM_L3 = ("a-l3", "b-l3")


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> RankResult:
    path = tmp_path_factory.mktemp("l3-alone")
    return run_scenario(SINGLE_RANK, Scenario(_config(path, 1), STEPS))


def _assert_ranks_alike(leader: RankResult, follower: RankResult) -> None:
    assert follower.tokens == leader.tokens
    assert follower.storage_tokens == leader.storage_tokens
    assert leader.num_ticks == follower.num_ticks
    assert leader.agreed == follower.agreed
    assert leader.tree_device_pages == follower.tree_device_pages
    assert leader.tree_host_pages == follower.tree_host_pages
    assert leader.num_free_device_pages == follower.num_free_device_pages
    assert leader.num_free_host_pages == follower.num_free_host_pages
    assert leader.free_host_pages == follower.free_host_pages  # at every tick


def test_tp2_reads_back_from_l3_like_one_rank(alone: RankResult, tmp_path: Path) -> None:
    assert all(alone.storage_tokens[rid] > 0 for rid in FROM_L3)  # L3 served them alone
    scenario = Scenario(_config(tmp_path, 2), STEPS)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    assert leader.tokens == alone.tokens
    assert leader.storage_tokens == alone.storage_tokens
    assert leader.cached == alone.cached


# Cold requests, a flush, a warm of both prompts from L3 into L2, the prompts again.
WARM_STEPS = (
    Step((_request("a", 1, 23), _request("b", 2, 30)), op_after="flush",
         warm_after=(prompt(1, 23, VOCAB), prompt(2, 30, VOCAB))),
    Step((_request("a-l2", 1, 23), _request("b-l2", 2, 30))),
)


def test_tp2_warms_l2_from_l3_like_one_rank(alone: RankResult, tmp_path: Path) -> None:
    single = run_scenario(SINGLE_RANK, Scenario(_config(tmp_path / "alone", 1), WARM_STEPS))
    (warmed,) = single.warm_results
    assert [(r["outcome"], r["tokens"]) for r in warmed] == [("warmed", 20), ("warmed", 28)]
    assert single.cached["a-l2"] == (0, 20) and single.cached["b-l2"] == (0, 28)
    assert single.storage_tokens["a-l2"] == single.storage_tokens["b-l2"] == 0
    assert single.tokens["a-l2"] == alone.tokens["a"]

    scenario = Scenario(_config(tmp_path / "tp", 2), WARM_STEPS)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    assert leader.warm_results == single.warm_results
    assert leader.cached == single.cached
    assert leader.tokens == single.tokens


@pytest.mark.parametrize(("rank", "call"), [(1, "exists"), (0, "get"), (1, "get")])
def test_a_rank_whose_l3_falls_short_shortens_the_prefix_for_all(
    alone: RankResult, tmp_path: Path, rank: int, call: str
) -> None:
    fault = L3Fault(rank=rank, call=call, num_pages=SHORT_PAGES)
    scenario = dataclasses.replace(Scenario(_config(tmp_path, 2), STEPS), l3_fault=fault)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    # The prefix every rank took is what the short rank had; the outputs do not change.
    for rid in FROM_L3:
        assert leader.storage_tokens[rid] == alone.storage_tokens[rid] - SHORT_PAGES * PAGE_SIZE
    assert leader.tokens == alone.tokens


# A read answering this late on one rank: past the prefetch deadline (prefetch_timeout_max,
# wait_complete), far within the call deadline (io_timeout_s, 10 s by default).
LATE_READ_S = 1.5
# The call deadline where a call must stall: every other call (lookups, backups, the other
# rank's reads) answers far within it on a busy machine, so only the late call stalls.
IO_TIMEOUT_S = 2.0
# A call answering this late stalls: still running when its deadline passes, with room for
# a busy machine to notice late.
LATE_CALL_S = IO_TIMEOUT_S + 2.0


@pytest.mark.parametrize(
    ("rank", "storage_options", "stalls"),
    [
        (1, {"prefetch_timeout_max": 0.2}, False),
        (1, {"io_timeout_s": IO_TIMEOUT_S}, True),
        (0, {"io_timeout_s": IO_TIMEOUT_S}, True),
    ],
    ids=["rank1-past-prefetch-deadline", "rank1-stalls", "rank0-stalls"],
)
def test_a_rank_whose_l3_reads_late_gives_the_same_prefix_on_every_rank(
    alone: RankResult, tmp_path: Path, rank: int, storage_options: dict[str, float],
    stalls: bool,
) -> None:
    # Every read of the late rank answers late: the first prefetch's would not hold the
    # second one back when the call stalls (the read thread moves on).
    fault = L3Fault(rank=rank, call="get", delay_s=LATE_CALL_S if stalls else LATE_READ_S,
                    num_delayed_calls=2)
    config = _config(tmp_path, 2, **storage_options)
    scenario = dataclasses.replace(Scenario(config, STEPS), l3_fault=fault)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    late, other = (leader, follower) if rank == 0 else (follower, leader)
    assert late.num_stalled_calls == (1 if stalls else 0) and other.num_stalled_calls == 0
    # The stalled call returned (the group waited for it) and its pages were freed on the
    # late rank at the tick the other rank freed its own (free host pages alike per tick).
    assert late.num_quarantined_pages == 0
    # The other rank had every page in time, the late one none: nobody took any, so the
    # requests recomputed the prefix, with the single-rank engine's outputs.
    for rid in FROM_L3:
        assert alone.storage_tokens[rid] > 0 and leader.storage_tokens[rid] == 0
    assert leader.tokens == alone.tokens


@pytest.mark.parametrize(
    ("policy", "late_rank", "storage_options"),
    [
        (PrefetchPolicy.BEST_EFFORT, None, {}),
        (PrefetchPolicy.BEST_EFFORT, 1, {}),
        # A deadline no read misses here, then one the late rank's reads miss.
        (PrefetchPolicy.TIMEOUT, None, {"prefetch_timeout_base": 20.0}),
        (PrefetchPolicy.TIMEOUT, 1, {"prefetch_timeout_base": 0.2,
                                     "prefetch_timeout_per_ki_token": 0.0}),
    ],
    ids=["best_effort", "best_effort-rank1-late", "timeout", "timeout-rank1-late"],
)
def test_every_prefetch_policy_gives_the_same_prefix_on_every_rank(
    alone: RankResult, tmp_path: Path, policy: PrefetchPolicy, late_rank: int | None,
    storage_options: dict[str, float],
) -> None:
    fault = None
    if late_rank is not None:
        fault = L3Fault(rank=late_rank, call="get", delay_s=LATE_READ_S, num_delayed_calls=2)
    config = _config(tmp_path, 2, prefetch_policy=policy, **storage_options)
    scenario = dataclasses.replace(Scenario(config, STEPS), l3_fault=fault)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    assert leader.tokens == alone.tokens
    for rid in FROM_L3:
        took, had = leader.storage_tokens[rid], alone.storage_tokens[rid]
        if policy is PrefetchPolicy.BEST_EFFORT:
            # What had landed when the request was scheduled: timing, but alike on every rank.
            assert 0 <= took <= had
        elif late_rank is None:
            assert took == had
        else:
            assert took == 0  # the deadline passed before the late rank's reads answered


# Cold requests whose backups go to L3, then a long one that runs while the late rank's
# first write is stalled (no flush: the backups are acknowledged by agreement).
BACKUP_STEPS = (
    Step((_request("a", 1, 23), _request("b", 2, 30))),
    Step((GenerateRequest(input_ids=prompt(3, 20, VOCAB), sampling=greedy(200), rid="long"),)),
)


def test_a_rank_whose_l3_write_stalls_keeps_the_node_protected_on_every_rank(
    tmp_path: Path,
) -> None:
    """A backup whose ``set`` stalled on one rank is acknowledged (its node unprotected)
    only once that call returned there: until then the stalled rank must keep the node
    out of eviction, and so must every other rank."""
    alone = run_scenario(SINGLE_RANK, Scenario(_config(tmp_path / "alone", 1), BACKUP_STEPS))
    fault = L3Fault(rank=1, call="set", delay_s=LATE_CALL_S)
    config = _config(tmp_path / "tp2", 2, io_timeout_s=IO_TIMEOUT_S)
    scenario = dataclasses.replace(Scenario(config, BACKUP_STEPS), l3_fault=fault)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    _assert_ranks_alike(leader, follower)
    assert leader.host_protected_nodes == follower.host_protected_nodes  # at every tick
    assert follower.num_stalled_calls == 1 and leader.num_stalled_calls == 0
    assert follower.num_quarantined_pages == 0
    assert leader.tokens == alone.tokens


def _agree_l3(tp: TPGroup, _: None) -> Progress:
    r = tp.rank
    slots = (SlotProgress(1, 5 + r, 4 - r, 1, r), SlotProgress(r, 0, 0, 0, 1))
    return agree(tp, Progress(1, L3Progress(num_done_backups=3 - r, slots=slots)))


def test_l3_progress_is_agreed_field_by_field() -> None:
    slots = (SlotProgress(1, 5, 3, 1, 0), SlotProgress(0, 0, 0, 0, 1))
    expected = Progress(1, L3Progress(2, slots))
    assert run_ranks(_agree_l3, 2, None) == [expected, expected]
    # Fixed shape whatever the slots in use (the collective never changes shape).
    tensor = expected.to_tensor()
    num_fields = 2 + NUM_SLOTS * SlotProgress.NUM_FIELDS
    assert tuple(tensor.shape) == (Progress.NUM_FIELDS,) == (num_fields,)
    assert tuple(Progress(0).to_tensor().shape) == (Progress.NUM_FIELDS,)
    assert Progress.from_tensor(tensor, num_slots=2) == expected
