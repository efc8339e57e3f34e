"""MooncakeSharedPool against a real mooncake_master, written to by a real cache.

Skipped where the mooncake client cannot be imported (tests.mooncake_fixtures
skips the module before anything here needs the client).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from hicache.config import MemLayout
from hicache.events.hashing import page_hashes
from hicache.net import free_port
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, TierAwarePolicy, build_policy
from hicache.router.shared_pool import MooncakeSharedPool, SharedPoolError
from hicache.router.types import RouteRequest, WorkerLoad
from hicache.testing.mooncake_master import MasterProcess, start_master
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    make_cache,
    master_fixture,
)
from tests.waiting import wait_until

PAGE = 4
# What "at once" is told apart from: the Mooncake library retries an unreachable master for
# over a minute. Far under that, and generous for a machine busy with other work.
AT_ONCE_S = 20.0


def test_the_pool_finds_the_pages_a_worker_backed_up(
    mooncake_master: MasterProcess, mooncake_extra: dict[str, Any],
) -> None:
    # The cache stays open: its client lends the segment the pages live in.
    cache = make_cache(mooncake_extra, page_size=PAGE, layout=MemLayout.PAGE_FIRST)
    assert cache.storage is not None, cache.storage_error
    tokens = conversation(40, seed=11)
    seed = cache.tree.seed(None)
    pool = MooncakeSharedPool(mooncake_master.address, seed.hex(), PAGE, MemLayout.PAGE_FIRST)
    try:
        serve_with_l3(cache, tokens)
        settle(cache)
        assert cache.stats.num_storage_backed_up_pages == 10
        asked = tokens + [5] * 12
        hits = asyncio.run(pool.hits(page_hashes(asked, PAGE), asked))
        assert hits == [True] * 10 + [False] * 3
        # Another row order names other objects.
        other = MooncakeSharedPool(mooncake_master.address, seed, PAGE, MemLayout.LAYER_FIRST)
        try:
            assert asyncio.run(other.hits(page_hashes(tokens, PAGE), tokens)) == [False] * 10
        finally:
            other.close()
    finally:
        pool.close()
        cache.close()


def test_an_unreachable_master_fails_fast_and_the_policy_scores_without_it() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    pool = MooncakeSharedPool(address, bytes(16), PAGE)
    tokens = conversation(16)
    hashes = page_hashes(tokens, PAGE)
    try:
        began = time.monotonic()
        try:
            asyncio.run(pool.hits(hashes, tokens))
            raise AssertionError("an unreachable master answered")
        except SharedPoolError as error:
            assert address in str(error)
        assert time.monotonic() - began < AT_ONCE_S
        policy = build_policy("tier_aware", PageIndex(), pool,
                              ScoringConfig(shared_cache_multiplier=0.5))
        request = RouteRequest(page_hashes=hashes, prompt_tokens=16, page_size=PAGE,
                               workers=[WorkerLoad("a"), WorkerLoad("b")])
        began = time.monotonic()
        decision = asyncio.run(policy.choose(request, tokens))
        assert time.monotonic() - began < AT_ONCE_S
    finally:
        pool.close()
    assert decision.shared_hits is None
    assert decision.worker == "a"
    assert decision.logits == {"a": 4.0, "b": 4.0}


def test_a_master_that_dies_fails_queries_fast_and_routing_goes_on() -> None:
    tokens = conversation(16, seed=5)
    hashes = page_hashes(tokens, PAGE)
    with start_master() as master:
        pool = MooncakeSharedPool(master.address, bytes(16), PAGE)
        # A deadline no loaded machine misses while the master answers; a short one once
        # it is dead.
        patient = ScoringConfig(shared_cache_multiplier=0.5, shared_deadline_s=30.0)
        policy = build_policy("tier_aware", PageIndex(), pool, patient)
        assert isinstance(policy, TierAwarePolicy)
        request = RouteRequest(page_hashes=hashes, prompt_tokens=16, page_size=PAGE,
                               workers=[WorkerLoad("a"), WorkerLoad("b")])
        try:
            # The first query sets the client up (longer than a deadline); then it answers.
            assert asyncio.run(pool.hits(hashes, tokens)) == [False] * 4
            assert asyncio.run(policy.choose(request, tokens)).shared_hits == 0
            policy.config = dataclasses.replace(patient, shared_deadline_s=0.5)
            master.kill()
            for _ in range(3):  # each routed in about the deadline, the pool answering or not
                began = time.monotonic()
                decision = asyncio.run(policy.choose(request, tokens))
                assert time.monotonic() - began < AT_ONCE_S
                assert decision.shared_hits is None and decision.worker in ("a", "b")
            # Once the client's watcher saw the master gone, a query fails at once.
            # The default guard of a minute: the watcher checks every 0.5 s.
            assert wait_until(lambda: not pool._client.usable()), "the dead master went unnoticed"
            began = time.monotonic()
            with pytest.raises(SharedPoolError, match=r"not answering|still running"):
                asyncio.run(pool.hits(hashes, tokens))
            assert time.monotonic() - began < AT_ONCE_S
        finally:
            pool.close()
