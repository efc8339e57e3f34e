"""Hints under tensor parallelism (2 ranks, gloo over loopback): a request's own hints and
a hints operation take the same decisions on every rank at the same tick, a retain's
expiry included (it reads rank 0's tick clock), so the ranks' pinned and retained pages
and their trees stay alike, and the outputs are the single-rank engine's."""

from __future__ import annotations

import dataclasses

import pytest

from hicache.config import CacheConfig
from hicache.distributed.group import SINGLE_RANK
from hicache.engine.api import GenerateRequest, Hint, HintKind
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from tests.ranks import run_ranks
from tests.tp_engine_ranks import RankResult, Scenario, Step, greedy, prompt, run_scenario

VOCAB = 500  # below the tiny preset's vocabulary
PAGE = 4
CONFIG = EngineConfig(
    model=ModelLoadConfig(preset="tiny", device="cpu", dtype="float32"),
    scheduling=SchedulingConfig(max_total_tokens=512),
    cache=CacheConfig(page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0),
)
TP2 = dataclasses.replace(CONFIG, parallel=ParallelConfig(tp_size=2))
# Far shorter than the scenario: the retain ends while it runs, at a tick of rank 0's clock.
SHORT_TTL_S = 0.001


def _request(rid: str, seed: int, length: int, hints: tuple[Hint, ...] = ()) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt(seed, length, VOCAB), sampling=greedy(), rid=rid,
                           hints=hints)


def _steps() -> tuple[Step, ...]:
    own = (Hint(HintKind.RETAIN, ttl_s=SHORT_TTL_S), Hint(HintKind.PIN, tenant="t"))
    pinned = prompt(2, 30, VOCAB)
    return (
        Step((_request("a", 1, 41, own), _request("b", 2, 30, (Hint(HintKind.DEMOTE),)))),
        Step(tuple(_request(f"p{i}", 10 + i, 60) for i in range(6)),
             op_after="evict_device_cache",
             hints_after=(Hint(HintKind.PIN, pinned, tenant="u"),
                          Hint(HintKind.RETAIN, prompt(1, 41, VOCAB), ttl_s=3600.0))),
        Step((_request("a-again", 1, 41), _request("b-again", 2, 30))),
    )


@pytest.fixture(scope="module")
def alone() -> RankResult:
    return run_scenario(SINGLE_RANK, Scenario(CONFIG, _steps()))


def test_hints_take_the_same_decisions_on_every_rank(alone: RankResult) -> None:
    leader, follower = run_ranks(run_scenario, 2, Scenario(TP2, _steps()))
    assert follower.tokens == leader.tokens == alone.tokens
    assert leader.cached == alone.cached
    assert leader.hint_results == alone.hint_results
    [[pin, retain]] = leader.hint_results
    assert (pin["outcome"], retain["outcome"]) == ("accepted", "accepted")
    # The same pinned and retained pages at every tick, the short retain's end included.
    assert leader.hinted_pages == follower.hinted_pages
    retained = [r for _, r in leader.hinted_pages]
    first = next(i for i, r in enumerate(retained) if r > 0)
    assert 0 in retained[first:]  # the short retain expired
    assert retained[-1] > 0  # the long one holds
    assert leader.hinted_pages[-1][0] > 0  # and the pins
    assert leader.tree_device_pages == follower.tree_device_pages
    assert leader.tree_host_pages == follower.tree_host_pages
    assert leader.num_free_host_pages == follower.num_free_host_pages
