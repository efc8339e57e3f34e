"""L3 prefetches start when a request arrives, so that its time in the queue hides them.

With one request allowed to run and a long one running, requests queued behind
it fetch their prefixes from L3 meanwhile, as far as the prefetch budget of the
host pool allows (the rest when room frees), and answer exactly as cold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.storage.config import PrefetchPolicy
from tests.engine_helpers import Run, collect, on_scheduler, run
from tests.integration.engine.test_engine_l3_faults import PAGE, REUSED, engine_with_store, prompt
from tests.storage_reference import MemoryBackend
from tests.waiting import wait_until_async

POLL_S = 0.01
WAIT_S = 20.0
LONG_TOKENS = 1500  # the running request: far longer than any prefetch here


def greedy(ids: list[int], n: int = 8) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(tuple(ids), params)


@dataclass(frozen=True)
class Queue:
    """The scheduler as one step left it."""

    running_prompts: tuple[tuple[int, ...], ...]
    storage_tokens: tuple[int, ...]  # of each waiting request, queue order: L3 tokens landed
    prefetch_tried: tuple[bool, ...]
    prefetching: tuple[bool, ...]  # its prefetch is not settled yet


def queue_state(engine: Engine) -> Queue:
    def take() -> Queue:
        sched = engine.scheduler
        return Queue(
            tuple(r.request.input_ids for r in sched.running_requests()),
            tuple(r.storage_tokens for r in sched.waiting_requests()),
            tuple(r.prefetch_tried for r in sched.waiting_requests()),
            tuple(r.prefetch is not None for r in sched.waiting_requests()),
        )

    state = on_scheduler(engine, take)
    assert isinstance(state, Queue)
    return state


def in_l3_only(engine: Engine, backend: MemoryBackend, prompts: list[list[int]]) -> list[Run]:
    """Answer ``prompts`` cold, then keep their KV in L3 alone; returns the cold answers."""
    cold = [run(engine, ids, ignore_eos=True) for ids in prompts]
    assert engine.flush_cache()  # drains the L3 backups, empties L1 and L2
    assert len(backend.store.pages) >= len(prompts) * REUSED // PAGE
    return cold


async def while_long_request_runs(
    engine: Engine, requests: list[GenerateRequest], until: Callable[[Queue], bool],
) -> tuple[Queue, list[Run]]:
    """Queue ``requests`` behind a long running one; once ``until`` the queue, end it.

    Returns the queue that satisfied ``until`` and the queued requests' answers.
    """
    long_ids = prompt(99)
    long_stream = engine.generate(greedy(long_ids, n=LONG_TOKENS))
    await anext(long_stream)  # it runs, and with --max-running-requests 1 alone
    queued = [asyncio.ensure_future(collect(engine, r)) for r in requests]
    state = queue_state(engine)

    def reached() -> bool:
        nonlocal state
        state = queue_state(engine)
        # The long request has not finished: it is the one running, the others wait.
        assert state.running_prompts == (tuple(long_ids),), "the long request finished first"
        return len(state.storage_tokens) == len(requests) and until(state)

    assert await wait_until_async(reached, WAIT_S, POLL_S), state
    await long_stream.aclose()
    return state, list(await asyncio.gather(*queued))


def answered_from_l3(engine: Engine, answer: Run, cold: Run) -> None:
    """``answer`` read its whole reused prefix from L3 and equals the cold answer."""
    assert answer.last.error is None
    assert answer.last.cached_tokens.storage == REUSED
    assert answer.token_ids == cold.token_ids
    engine.check_integrity()


def test_a_queued_request_prefetches_while_another_runs(
    make_engine: Callable[..., Engine],
) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, flags=("--max-running-requests", "1")
    )
    ids = prompt(4)
    [cold] = in_l3_only(engine, backend, [ids])

    def landed(queue: Queue) -> bool:
        return queue.storage_tokens == (REUSED,)

    _, [answer] = asyncio.run(while_long_request_runs(engine, [greedy(ids)], landed))
    answered_from_l3(engine, answer, cold)


def test_a_long_queue_prefetches_within_the_host_budget(
    make_engine: Callable[..., Engine],
) -> None:
    # A budget of 25 host pages, 12 pages a prefix: two queued prefetches start, the
    # other four once room frees (whole: a third now would get only the page left).
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, flags=("--max-running-requests", "1"),
        prefetch_max_host_fraction=25.5 / 256,
    )
    assert engine.cache.host_pool is not None and engine.cache.host_pool.num_pages == 256
    assert engine.cache.prefetch_budget_pages == 25
    prompts = [prompt(10 + i) for i in range(6)]
    cold = in_l3_only(engine, backend, prompts)

    def settled(queue: Queue) -> bool:
        return queue.storage_tokens == (REUSED,) * 2 + (0,) * 4

    state, answers = asyncio.run(
        while_long_request_runs(engine, [greedy(ids) for ids in prompts], settled)
    )
    assert state.prefetch_tried == (True,) * 2 + (False,) * 4
    for answer, before in zip(answers, cold, strict=True):
        assert answer.last.error is None
        assert answer.last.cached_tokens.storage == REUSED  # the last three too, later
        assert answer.token_ids == before.token_ids
    engine.check_integrity()


def evict_every_host_page(engine: Engine) -> None:
    """What the backups of running requests do under load: take the host pool's pages
    (evicting every host-only leaf nothing holds), then give them back empty."""
    cache = engine.cache
    assert cache.host_pool is not None
    pages = cache.alloc_host(cache.host_pool.num_pages)
    cache.host_pool.allocator.free(pages)


def test_a_prefix_evicted_from_the_host_while_queued_is_fetched_again(
    make_engine: Callable[..., Engine],
) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, flags=("--max-running-requests", "1")
    )
    ids = prompt(5)
    [cold] = in_l3_only(engine, backend, [ids])
    cached_after: list[int] = []

    def landed_then_evicted(queue: Queue) -> bool:
        if queue.storage_tokens != (REUSED,):
            return False
        # Its prefetch landed and joined the tree; now the host loses it, as it did
        # behind a queue of long prefills, before the request is admitted.
        on_scheduler(engine, lambda: evict_every_host_page(engine))
        peek = on_scheduler(engine, lambda: engine.cache.peek(ids))
        cached_after.append(peek.num_device_pages + peek.num_host_pages)
        return True

    _, [answer] = asyncio.run(
        while_long_request_runs(engine, [greedy(ids)], landed_then_evicted)
    )
    assert cached_after == [0]
    answered_from_l3(engine, answer, cold)  # read from L3 again at admission, not recomputed


def test_a_prefetch_that_found_no_host_room_is_tried_again_at_admission(
    make_engine: Callable[..., Engine],
) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, flags=("--max-running-requests", "1")
    )
    ids = prompt(6)
    [cold] = in_l3_only(engine, backend, [ids])
    allocator = engine.cache.host_pool.allocator if engine.cache.host_pool else None
    assert allocator is not None
    # Every host page taken (the L1 and L2 are empty after the flush): the queued request's
    # prefetch finds its pages in L3 and gets no host page for them.
    taken = on_scheduler(engine, lambda: allocator.allocate(allocator.num_free_pages))

    def settled_empty_then_room(queue: Queue) -> bool:
        if queue.prefetch_tried != (True,) or queue.prefetching != (False,):
            return False
        assert queue.storage_tokens == (0,)
        on_scheduler(engine, lambda: allocator.free(taken))  # room again before admission
        return True

    _, [answer] = asyncio.run(
        while_long_request_runs(engine, [greedy(ids)], settled_empty_then_room)
    )
    answered_from_l3(engine, answer, cold)
