"""Routing policies: Dynamo's shared-cache scoring, the tiers beyond it, and the shared-pool
fallback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest

from hicache.events.hashing import page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    BlockStored,
    KVEventBatch,
)
from hicache.router.index import PageIndex
from hicache.router.policy import (
    NoWorkerError,
    ScoringConfig,
    build_policy,
    hits_beyond,
)
from hicache.router.shared_pool import InMemorySharedPool
from hicache.router.types import RouteDecision, RouteRequest, TierCosts, TierOverlap, WorkerLoad

TOKENS = list(range(100, 116))


def store(index: PageIndex, worker: str, hashes: Sequence[int], medium: str, page: int) -> None:
    event = BlockStored(list(hashes), None, [0] * (page * len(hashes)), page, None, medium)
    index.apply(worker, KVEventBatch(ts=0.0, events=[event]))


def route(
    policy_name: str, index: PageIndex, request: RouteRequest, *,
    shared: object = None, tokens: Sequence[int] = TOKENS, **config: object,
) -> RouteDecision:
    policy = build_policy(policy_name, index, shared, ScoringConfig(**config))  # type: ignore[arg-type]
    return asyncio.run(policy.choose(request, tokens))


def dynamo_example() -> tuple[PageIndex, RouteRequest, InMemorySharedPool]:
    """Dynamo's shared-cache worked example: 4 pages of 1 token; W0 holds pages 0-1 on
    device, W1 nothing; the shared pool holds pages 0-3."""
    pages = page_hashes(TOKENS[:4], 1)
    index = PageIndex()
    store(index, "W0", pages[:2], MEDIUM_GPU, 1)
    request = RouteRequest(
        page_hashes=pages, prompt_tokens=4, page_size=1,
        workers=[WorkerLoad("W0"), WorkerLoad("W1")],
    )
    return index, request, InMemorySharedPool(pages)


def test_dynamo_worked_example_with_no_device_credit() -> None:
    index, request, shared = dynamo_example()
    decision = route("tier_aware", index, request, shared=shared, tokens=TOKENS[:4],
                     shared_cache_multiplier=0.5, device_credit=0.0)
    assert decision.logits == {"W0": 3.0, "W1": 2.0}
    assert decision.worker == "W1"
    assert decision.policy == "tier_aware"
    assert decision.shared_hits == 4
    assert decision.shared_beyond == 4  # W1 has no device prefix: every shared page is beyond
    # The index knows only what the workers announced (no EXTERNAL event here).
    assert decision.overlaps == {"W0": TierOverlap(2, 2, 2), "W1": TierOverlap(0, 0, 0)}


def test_dynamo_example_with_the_default_device_credit() -> None:
    # W0 does not recompute its device pages: 4 - 2 - 0.5 * 2 = 1 page left, against W1's 2.
    index, request, shared = dynamo_example()
    decision = route("tier_aware", index, request, shared=shared, tokens=TOKENS[:4],
                     shared_cache_multiplier=0.5)
    assert decision.logits == {"W0": 1.0, "W1": 2.0}
    assert decision.worker == "W0"
    assert decision.shared_beyond == 2


def test_per_request_multiplier_overrides_the_router_default() -> None:
    index, request, shared = dynamo_example()
    # The router's default 0.0 asks the pool but ignores it: W0's device pages win.
    plain = route("tier_aware", index, request, shared=shared, device_credit=0.0)
    assert plain.logits == {"W0": 4.0, "W1": 4.0}
    assert plain.worker == "W0"  # a tie: registration order
    assert plain.shared_hits == 4
    override = RouteRequest(**{**request.__dict__, "shared_cache_multiplier": 0.5})
    decision = route("tier_aware", index, override, shared=shared, device_credit=0.0)
    assert decision.logits == {"W0": 3.0, "W1": 2.0}


def test_host_pages_past_the_device_prefix_count() -> None:
    page = 4
    pages = page_hashes(TOKENS, page)  # 4 pages
    index = PageIndex()
    store(index, "gpu", pages[:1], MEDIUM_GPU, page)
    store(index, "host", pages[:1], MEDIUM_GPU, page)
    store(index, "host", pages[1:4], MEDIUM_CPU, page)
    request = RouteRequest(page_hashes=pages, prompt_tokens=18, page_size=page,
                           workers=[WorkerLoad("gpu"), WorkerLoad("host")])
    decision = route("tier_aware", index, request)
    # gpu: (18 - 4) / 4 = 3.5; host: 3.5 - 0.9 * 3 = 0.8
    assert decision.logits["gpu"] == pytest.approx(3.5)
    assert decision.logits["host"] == pytest.approx(0.8)
    assert decision.worker == "host"
    # Device overlap alone cannot tell them apart; cache_aware keeps registration order.
    cache_aware = route("cache_aware", index, request)
    assert cache_aware.logits == {"gpu": 3.5, "host": 3.5}
    assert cache_aware.worker == "gpu"


def test_measured_costs_price_each_workers_tiers() -> None:
    page = 4
    pages = page_hashes(TOKENS, page)
    index = PageIndex()
    store(index, "slow", pages, MEDIUM_CPU, page)
    store(index, "fast", pages[:2], MEDIUM_CPU, page)
    shared = InMemorySharedPool(pages)
    costs = {"slow": TierCosts(host=0.9, external=0.5), "fast": TierCosts(host=0.0, external=0.25)}
    request = RouteRequest(page_hashes=pages, prompt_tokens=16, page_size=page,
                           workers=[WorkerLoad("slow"), WorkerLoad("fast")])
    policy = build_policy("tier_aware", index, shared, ScoringConfig(tier_costs="measured"), costs)
    decision = asyncio.run(policy.choose(request, TOKENS))
    # slow: 4 - 0.1 * 4 = 3.6; fast: 4 - 1.0 * 2 - 0.75 * 2 = 0.5
    assert decision.logits["slow"] == pytest.approx(3.6)
    assert decision.logits["fast"] == pytest.approx(0.5)
    # A worker with no measurement gets the defaults (host 0.1, external 0.5).
    costs.pop("slow")
    decision = asyncio.run(policy.choose(request, TOKENS))
    assert decision.logits["slow"] == pytest.approx(4 - 0.9 * 4)


def test_decode_blocks_and_load_break_ties() -> None:
    pages = page_hashes(TOKENS, 4)
    index = PageIndex()
    request = RouteRequest(
        page_hashes=pages, prompt_tokens=16, page_size=4,
        workers=[WorkerLoad("a", 3, 2.0), WorkerLoad("b", 1, 2.0), WorkerLoad("c", 0, 2.5)],
    )
    decision = route("cache_aware", index, request)
    assert decision.logits == {"a": 6.0, "b": 6.0, "c": 6.5}
    assert decision.worker == "b"  # equal logits: fewer active requests
    least = route("least_load", index, request)
    assert least.worker == "c"
    request = RouteRequest(page_hashes=pages, prompt_tokens=16, page_size=4,
                           workers=[WorkerLoad("a", 1, 9.0), WorkerLoad("b", 1, 2.0)])
    assert route("least_load", index, request).worker == "b"


@pytest.mark.parametrize("name", ["cache_aware", "tier_aware", "least_load", "predicted_ttft"])
def test_new_conversations_on_an_idle_cluster_spread_over_the_workers(name: str) -> None:
    # Every worker idle and empty: all score the same for each new prompt. They take
    # turns (the one chosen least recently), not all the first registered worker.
    index = PageIndex()
    workers = [WorkerLoad("a"), WorkerLoad("b"), WorkerLoad("c")]
    policy = build_policy(name, index, None, ScoringConfig())

    async def decide(tokens: list[int], load: list[WorkerLoad]) -> str:
        request = RouteRequest(page_hashes=page_hashes(tokens, 4), prompt_tokens=len(tokens),
                               page_size=4, workers=load)
        return (await policy.choose(request, tokens)).worker

    async def scenario() -> list[str]:
        chosen = [await decide(list(range(k * 100, k * 100 + 16)), workers) for k in range(4)]
        # A tie still goes to fewer requests in flight before recency: "c" was chosen
        # longest ago of the tied workers, but it is busy.
        busy_c = [WorkerLoad("a"), WorkerLoad("b"), WorkerLoad("c", active_requests=1)]
        chosen.append(await decide(list(range(900, 916)), busy_c))
        return chosen

    assert asyncio.run(scenario()) == ["a", "b", "c", "a", "b"]


def test_round_robin_takes_turns_and_still_reports_overlaps() -> None:
    pages = page_hashes(TOKENS, 4)
    index = PageIndex()
    store(index, "b", pages[:2], MEDIUM_GPU, 4)
    workers = [WorkerLoad("a"), WorkerLoad("b"), WorkerLoad("c")]
    request = RouteRequest(page_hashes=pages, prompt_tokens=16, workers=workers)
    policy = build_policy("round_robin", index, None, ScoringConfig())

    async def four() -> list[RouteDecision]:
        return [await policy.choose(request, TOKENS) for _ in range(4)]

    decisions = asyncio.run(four())
    assert [d.worker for d in decisions] == ["a", "b", "c", "a"]
    assert decisions[0].logits == {}
    assert decisions[0].overlaps["b"] == TierOverlap(2, 2, 2)


class FailingPool:
    def __init__(self) -> None:
        self.calls = 0

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        self.calls += 1
        raise ConnectionError("master at 127.0.0.1:1 refused the connection")


class SlowPool:
    """Answers after a minute: far past any bound here (a query cut at its deadline is
    cancelled, so the minute is never waited for)."""

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        await asyncio.sleep(60.0)
        return [True] * len(page_hashes)


class ShortPool:
    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        return [True]


def external_example() -> tuple[PageIndex, RouteRequest]:
    """Pages 0-3 announced to the shared pool; W0 holds page 0 on device."""
    pages = page_hashes(TOKENS[:4], 1)
    index = PageIndex()
    store(index, "W0", pages[:1], MEDIUM_GPU, 1)
    store(index, "W2", pages, MEDIUM_EXTERNAL, 1)
    request = RouteRequest(page_hashes=pages, prompt_tokens=4, page_size=1,
                           workers=[WorkerLoad("W0"), WorkerLoad("W1")])
    return index, request


@pytest.mark.parametrize("pool", [FailingPool(), SlowPool(), ShortPool()],
                         ids=["failing", "slow", "wrong-length"])
def test_a_failed_shared_query_falls_back_to_the_index(
    pool: object, caplog: pytest.LogCaptureFixture,
) -> None:
    index, request = external_example()
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hicache.router.policy"):
        decision = route("tier_aware", index, request, shared=pool, tokens=TOKENS[:4],
                         shared_cache_multiplier=1.0, shared_deadline_s=0.05)
    assert time.monotonic() - began < 20.0  # the slow pool is not waited for
    assert decision.shared_hits is None
    assert decision.shared_beyond == 0
    # From the index: W0 3 pages to compute, less 1.0 * 3 announced shared pages; W1 4 - 4.
    assert decision.logits == {"W0": 0.0, "W1": 0.0}
    assert decision.worker == "W0"
    assert "scoring from the index alone" in caplog.text


def test_failure_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    index, request = external_example()
    pool = FailingPool()
    policy = build_policy("tier_aware", index, pool, ScoringConfig())

    async def three() -> None:
        for _ in range(3):
            assert (await policy.choose(request, TOKENS[:4])).shared_hits is None

    with caplog.at_level(logging.WARNING, logger="hicache.router.policy"):
        asyncio.run(three())
    assert pool.calls == 3
    assert len([r for r in caplog.records if "shared cache query" in r.message]) == 1


def test_hits_beyond_counts_pages_at_or_past_a_position() -> None:
    hits = [True, False, True, True]
    assert [hits_beyond(hits, n) for n in range(6)] == [3, 2, 2, 1, 0, 0]


def test_bad_requests_and_configs_are_refused() -> None:
    index, request = external_example()
    with pytest.raises(NoWorkerError):
        route("tier_aware", index, RouteRequest(page_hashes=[], prompt_tokens=1, workers=[]))
    with pytest.raises(ValueError, match="page_size"):
        route("cache_aware", index, RouteRequest(**{**request.__dict__, "page_size": None}))
    with pytest.raises(ValueError, match="shared_cache_multiplier"):
        route("tier_aware", index,
              RouteRequest(**{**request.__dict__, "shared_cache_multiplier": -1.0}))
    with pytest.raises(ValueError, match="round_robin, least_load, cache_aware, tier_aware"):
        build_policy("random", index, None, ScoringConfig())
    with pytest.raises(ValueError, match="tier_costs"):
        ScoringConfig(tier_costs="guessed")
    with pytest.raises(ValueError, match="overlap_weight"):
        ScoringConfig(overlap_weight=float("nan"))
    with pytest.raises(ValueError, match="shared_deadline_s"):
        ScoringConfig(shared_deadline_s=0)
