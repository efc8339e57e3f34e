"""Admission checks room before it touches the cache.

A request the device pool cannot take yet must leave everything as it was
while it waits: no load of its host prefix into the device pool (which evicts
other pages), no cache hit counted, step after step. Only when admitted does
it lock and load its prefix, and its hit is counted once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.engine.api import CachedTokens, GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect, on_scheduler, run
from tests.waiting import wait_until_async

PAGE = 4
POLL_S = 0.005
# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def greedy(ids: list[int], n: int) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(tuple(ids), params)


@dataclass(frozen=True)
class Snapshot:
    num_running: int
    num_waiting: int
    num_steps: int
    num_hit_requests: int  # requests the cache counted a hit (or miss) for
    num_loaded_pages: int  # host -> device load-backs


def snapshot(engine: Engine) -> Snapshot:
    def take() -> Snapshot:
        sched, stats = engine.scheduler, engine.cache.stats
        return Snapshot(sched.num_running, sched.num_waiting, sched.counters.num_steps,
                        stats.num_requests, stats.num_loaded_pages)

    result = on_scheduler(engine, take)
    assert isinstance(result, Snapshot)
    return result


def test_a_request_refused_for_room_neither_loads_nor_counts_its_host_prefix(
    make_engine: Callable[..., Engine],
) -> None:
    # A 128-page pool. The waiting request's first 9 pages are on the host only, and
    # all of it (85 pages) does not fit beside the long request that runs meanwhile.
    engine = make_engine(
        "--page-size", str(PAGE), "--max-total-tokens", "512", "--enable-hierarchical-cache"
    )
    shared = prompt(1, 40)
    run(engine, shared, ignore_eos=True)
    assert engine.evict_device_cache() > 0  # its KV is on the host only now
    host_hit = 9 * PAGE
    waiting_ids = shared[:host_hit] + prompt(2, 304)
    long_ids = prompt(3, 200)

    async def scenario() -> Run:
        long_stream = engine.generate(greedy(long_ids, n=300))
        await anext(long_stream)  # it runs
        before = snapshot(engine)
        waiting = asyncio.ensure_future(collect(engine, greedy(waiting_ids, n=8)))
        first_seen: int | None = None
        now = before

        def considered() -> bool:  # the scheduler considers the waiting request for a few steps
            nonlocal first_seen, now
            now = snapshot(engine)
            if first_seen is None and now.num_waiting == 1:
                first_seen = now.num_steps
            return first_seen is not None and now.num_steps >= first_seen + 5

        assert await wait_until_async(considered, WAIT_S, POLL_S), now
        assert (now.num_running, now.num_waiting) == (1, 1), "the pool was meant to be full"
        assert now.num_loaded_pages == before.num_loaded_pages, "a refused request loaded"
        assert now.num_hit_requests == before.num_hit_requests, "a refused request counted"
        await long_stream.aclose()  # the long request leaves: the waiting one fits now
        return await waiting

    before = engine.cache.stats.num_loaded_pages, engine.cache.stats.num_requests
    answer = asyncio.run(scenario())
    assert answer.last.error is None and answer.last.finish_reason == "length"
    # Its host prefix was loaded once, when admitted, and counted once, as a host hit.
    assert answer.last.cached_tokens == CachedTokens(device=0, host=host_hit, storage=0)
    stats = engine.cache.stats
    assert stats.num_loaded_pages == before[0] + host_hit // PAGE
    assert stats.num_requests == before[1] + 2
    cold = run(make_engine("--page-size", str(PAGE), "--disable-radix-cache"), waiting_ids,
               ignore_eos=True)
    assert answer.token_ids == cold.token_ids
    engine.check_integrity()
