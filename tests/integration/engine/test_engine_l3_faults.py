"""The engine over a misbehaving L3 (the in-memory reference store with injected faults).

A slow store is bounded by the timeout policy (and wait_complete by
prefetch_timeout_max), a failing one costs a recomputation, and a request
aborted while its prefetch is in flight frees every host page the prefetch
held. Outputs never change. A slow store here answers when the test releases
it, within the call deadline: as slow as a test needs, at no cost in time.
(A store that hangs past the call deadline: test_engine_l3_stall.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.engine_helpers import on_scheduler, run
from tests.l3_engine_checks import wait_for_hit
from tests.storage_reference import MemoryBackend
from tests.waiting import wait_until, wait_until_async

PAGE = 16
PROMPT = 200
REUSED = (PROMPT - 1) // PAGE * PAGE
# A request bounded by a prefetch deadline of a fraction of a second, over a store that
# answers only when the test lets it (far later than that, and within the call deadline
# IO_TIMEOUT_S): it finishes within SLOW_BOUND_S even on a machine busy with other work,
# while one that waited for the store would not finish before the test released it.
SLOW_BOUND_S = 20.0
IO_TIMEOUT_S = 120.0
# Waits for what the engine does in the background: guards against a hang, not bounds.
SETTLE_S = 60.0


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PROMPT,), generator=generator).tolist()


def engine_with_store(
    make_engine: Callable[..., Engine], policy: PrefetchPolicy, page: int = PAGE,
    flags: tuple[str, ...] = (), backend: MemoryBackend | None = None, **config: float,
) -> tuple[Engine, MemoryBackend]:
    """An engine (more ``flags`` for it) over an in-memory L3 (``backend``, or a new one)
    with the prefetch ``policy``."""
    engine = make_engine(
        "--page-size", str(page), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        *flags,  # later flags win
    )
    backend = MemoryBackend() if backend is None else backend
    storage = StorageConfig(
        backend="memory", prefetch_policy=policy, prefetch_threshold=page, **config  # type: ignore[arg-type]
    )
    on_scheduler(engine, lambda: engine.cache.attach_storage(storage, backend=backend))
    return engine, backend


def test_slow_store_is_bounded_by_the_timeout_policy(make_engine: Callable[..., Engine]) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.TIMEOUT, io_timeout_s=IO_TIMEOUT_S,
        prefetch_timeout_base=0.2, prefetch_timeout_per_ki_token=0.0,
    )
    ids = prompt(1)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    assert backend.store.pages  # backed up
    answer = backend.stall("get")  # reads answer when the test says: far past 0.2 s
    try:
        began = time.monotonic()
        slow = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < SLOW_BOUND_S
    finally:
        answer.set()
    assert slow.last.cached_tokens.storage == 0
    assert slow.token_ids == cold.token_ids
    wait_for_no_prefetch(engine)  # the late read returned; its pages are freed
    engine.check_integrity()


def test_wait_complete_gives_up_at_prefetch_timeout_max(
    make_engine: Callable[..., Engine],
) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, prefetch_timeout_max=0.3,
        io_timeout_s=IO_TIMEOUT_S,
    )
    ids = prompt(4)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    # Slow, not hung: the read answers when the test says, within the call deadline.
    answer = backend.stall("get")
    try:
        began = time.monotonic()
        slow = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < SLOW_BOUND_S
        # Given up on, not failed: the read is still in flight, holding its host pages.
        assert on_scheduler(engine, lambda: engine.cache.storage.num_in_flight_prefetch_pages)  # type: ignore[union-attr]
    finally:
        answer.set()
    assert slow.last.cached_tokens.storage == 0
    assert slow.token_ids == cold.token_ids
    # The read it gave up on returns later; its pages are freed then.
    wait_for_no_prefetch(engine)
    engine.check_integrity()


def wait_for_no_prefetch(engine: Engine) -> None:
    """Until no prefetch read is in flight (late ones returned, their pages freed)."""
    assert wait_until(
        lambda: not on_scheduler(engine, lambda: engine.cache.storage.num_in_flight_prefetch_pages),  # type: ignore[union-attr]
        SETTLE_S, poll_s=0.05,
    ), "a prefetch read stayed in flight"


def test_failing_store_costs_a_recomputation_only(make_engine: Callable[..., Engine]) -> None:
    engine, backend = engine_with_store(make_engine, PrefetchPolicy.WAIT_COMPLETE)
    ids = prompt(2)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    backend.raise_errors = True
    failed = run(engine, ids, ignore_eos=True)
    assert failed.last.cached_tokens.total == 0
    assert failed.token_ids == cold.token_ids
    backend.raise_errors = False
    # The failures opened the circuit breaker: L3 is skipped until its backoff ends.
    wait_for_hit(engine, ids, cold.token_ids, timeout_s=SETTLE_S, reused_tokens=REUSED,
                 poll_s=0.05)
    engine.check_integrity()


def test_abort_during_prefetch_frees_the_prefetched_host_pages(
    make_engine: Callable[..., Engine],
) -> None:
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, io_timeout_s=IO_TIMEOUT_S,
        prefetch_timeout_max=IO_TIMEOUT_S,
    )
    ids = prompt(3)
    run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    host = engine.cache.host_pool
    assert host is not None
    # Reads answer when the test says (after the client left), within the call deadline.
    answer = backend.stall("get")

    async def leave_while_prefetching() -> None:
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        stream = engine.generate(GenerateRequest(tuple(ids), params))
        reader = asyncio.ensure_future(anext(stream))
        assert await wait_until_async(
            lambda: engine.scheduler.num_waiting == 1 and host.allocator.num_used_pages > 0,
            SETTLE_S,
        ), "the prefetch never started"
        reader.cancel()  # the client goes away while the request waits for L3
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()

    try:
        asyncio.run(leave_while_prefetching())
    finally:
        answer.set()

    def settled() -> bool:
        if engine.is_idle() and not host.allocator.num_used_pages:
            return True
        on_scheduler(engine, engine.cache.poll)
        return False

    assert wait_until(settled, SETTLE_S, poll_s=0.05), (
        engine.is_idle(), host.allocator.num_used_pages
    )
    assert engine.scheduler.counters.num_aborted == 1
    engine.check_integrity()
