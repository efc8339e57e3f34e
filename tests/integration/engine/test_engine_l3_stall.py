"""The engine over an L3 store that hangs: calls that never return until released.

A hung call (a FIFO for a page file, a hung NFS mount, a stalled remote store)
must not hold requests, other L3 traffic or host memory: after its deadline
the request recomputes, the stall is logged and counted, the breaker opens,
and only the host pages the hung call may still touch stay reserved, until it
returns. Then L3 serves hits again, outputs never change, and every pool is
consistent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
import pytest

from hicache.cache.l3 import StorageTier
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.memory.allocator import PageIds
from hicache.storage.config import PrefetchPolicy
from tests.engine_helpers import Run, collect, on_scheduler, run
from tests.integration.engine.test_engine_l3_faults import PROMPT, engine_with_store, prompt
from tests.waiting import wait_until

# Every L3 call's deadline: the hung ones end only there (each test waits it out once), and
# no other call (a lookup, a backup, the hung one's neighbours) may come near it on a busy
# machine, or the stalls counted below would not be only the hung call's.
IO_TIMEOUT_S = 3.0
# Compute and scheduling on a machine busy with other work. The stalls these tests bound
# end only when the test releases them, so a request that waited on one would never finish
# (run_bounded fails it): the margin can be generous and still tell the two apart.
MARGIN_S = 30.0
BACKOFF_S = 0.2
# Waits for what the engine does in the background: guards against a hang, not bounds.
SETTLE_S = 60.0


def run_bounded(engine: Engine, ids: list[int], timeout_s: float = 2 * MARGIN_S) -> Run:
    """One greedy request that fails the test instead of hanging."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    async def bounded() -> Run:
        return await asyncio.wait_for(
            collect(engine, GenerateRequest(tuple(ids), params)), timeout_s
        )

    return asyncio.run(bounded())


def tier(engine: Engine) -> StorageTier:
    storage = engine.cache.storage
    assert storage is not None
    return storage


def until(
    engine: Engine, condition: Callable[[], bool], what: str, timeout_s: float = SETTLE_S
) -> None:
    """Wait until ``condition`` holds on the scheduler thread (which polls L3 each tick)."""
    assert wait_until(lambda: on_scheduler(engine, condition), timeout_s), (
        f"timed out waiting for {what}"
    )


def reserved_apart(engine: Engine, pages: PageIds) -> bool:
    """Are ``pages`` allocated, yet neither in the tree nor free (nobody else was given them)?"""

    def check() -> bool:
        host = engine.cache.host_pool
        assert host is not None
        in_tree = np.isin(pages, engine.cache.tree.host_page_ids()).any()
        return not in_tree and all(host.allocator.is_allocated(int(p)) for p in pages)

    return bool(on_scheduler(engine, check))


def logged(caplog: pytest.LogCaptureFixture, level: int, *parts: str) -> bool:
    return any(
        r.levelno == level and all(part in r.getMessage() for part in parts)
        for r in caplog.records
    )


def serves_from_l3_again(engine: Engine, ids: list[int], cold: Run, tokens: int) -> None:
    """After its backoff the breaker lets a call through, and L3 hits come back."""

    def hit() -> bool:
        assert engine.flush_cache()
        back = run_bounded(engine, ids)
        assert back.token_ids == cold.token_ids
        return back.last.cached_tokens.storage == tokens

    assert wait_until(hit, SETTLE_S, poll_s=0.05), engine.storage_status()


@pytest.mark.parametrize("policy", [PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.TIMEOUT])
def test_a_hung_get_is_left_behind_and_only_its_pages_wait_for_it(
    make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture, policy: PrefetchPolicy
) -> None:
    caplog.set_level(logging.INFO, logger="hicache.storage")
    # Page size 1: the prompt's 199 pages are read in two batches (128 + 71). Under
    # the timeout policy the request moves on (1 s: time for the lookup to answer and
    # the read to start on a busy machine) before the call's deadline.
    # A host pool of 588 pages: two prompts and the reserved pages fit, and pages
    # freed too early would be handed to the second prompt's host copy.
    engine, backend = engine_with_store(
        make_engine, policy, page=1, flags=("--max-total-tokens", "420", "--hicache-ratio", "1.4"),
        io_timeout_s=IO_TIMEOUT_S, breaker_backoff_base=BACKOFF_S,
        prefetch_timeout_base=1.0, prefetch_timeout_per_ki_token=0.0,
    )
    ids, fresh_ids = prompt(11), prompt(12)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    gate = backend.stall("get")
    try:
        began = time.monotonic()
        stalled = run_bounded(engine, ids)
        assert time.monotonic() - began < IO_TIMEOUT_S + MARGIN_S
        assert stalled.token_ids == cold.token_ids
        assert stalled.last.cached_tokens.storage == 0

        # Seen: logged, counted, the breaker open; the 71 pages of the batch that was
        # never read are free, the 128 the hung get may still write are reserved.
        until(engine, lambda: tier(engine).num_quarantined_pages == 128, "the quarantine")
        [hung] = backend.stalled_pages("get")
        assert len(hung) == 128
        metrics = tier(engine).metrics()
        assert metrics.failures.get("timeout") == 1
        assert (metrics.stalled_calls, metrics.stalled_host_pages) == (1, 128)
        assert tier(engine).breaker.num_opened >= 1
        assert logged(caplog, logging.WARNING, "(memory) get stalled", "128 host pages")
        assert tier(engine).num_in_flight_prefetch_pages == 128
        assert reserved_apart(engine, hung)
        engine.check_integrity()

        # New work takes the lowest free host pages, never the reserved ones.
        fresh = run_bounded(engine, fresh_ids)
        assert reserved_apart(engine, hung)
        engine.check_integrity()
    finally:
        gate.set()  # the store answers: the late get writes garbage into its pages

    until(engine, lambda: tier(engine).metrics().stalled_calls == 0, "the late return")
    until(engine, lambda: tier(engine).num_quarantined_pages == 0, "the pages' release")
    assert logged(caplog, logging.INFO, "(memory) answered again", "128 host pages")
    assert tier(engine).num_in_flight_prefetch_pages == 0
    engine.check_integrity()
    # The garbage landed in no one's KV: both prompts, back from L2, are unchanged
    # (the recomputed one's host copy was allocated while the get hung).
    assert engine.evict_device_cache() > 0
    for prompt_ids, first in ((ids, cold), (fresh_ids, fresh)):
        again = run_bounded(engine, prompt_ids)
        assert again.last.cached_tokens.host > 0
        assert again.token_ids == first.token_ids
    serves_from_l3_again(engine, ids, cold, PROMPT - 1)
    engine.check_integrity()


def test_a_hung_set_keeps_its_host_pages_until_it_returns(
    make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hicache.storage")
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, io_timeout_s=IO_TIMEOUT_S,
        breaker_backoff_base=BACKOFF_S,
    )
    ids = prompt(21)
    gate = backend.stall("set")
    try:
        began = time.monotonic()
        cold = run_bounded(engine, ids)  # its backup to L3 hangs behind it
        assert time.monotonic() - began < MARGIN_S
        until(engine, lambda: tier(engine).metrics().stalled_calls == 1, "the stall")
        [hung] = backend.stalled_pages("set")
        assert logged(caplog, logging.WARNING, "(memory) set stalled", f"{len(hung)} host pages")
        assert tier(engine).metrics().failures.get("timeout") == 1
        # The hung set reads these pages whenever it resumes: even a flush keeps them.
        assert engine.flush_cache()
        assert reserved_apart(engine, hung)
        engine.check_integrity()
        # New work takes the lowest free host pages, never the reserved ones.
        run_bounded(engine, prompt(22))
        assert reserved_apart(engine, hung)
        engine.check_integrity()
    finally:
        gate.set()  # the set resumes and stores what its pages hold by now

    until(engine, lambda: tier(engine).metrics().stalled_calls == 0, "the late returns")
    until(engine, lambda: tier(engine).num_quarantined_pages == 0, "the pages' release")
    assert logged(caplog, logging.INFO, "(memory) answered again")
    engine.check_integrity()
    # What the late set stored under this prompt's keys is this prompt's KV.
    serves_from_l3_again(engine, ids, cold, (PROMPT - 1) // 16 * 16)
    engine.check_integrity()


def test_a_hung_backup_does_not_delay_a_prefetch_read(make_engine: Callable[..., Engine]) -> None:
    # A deadline far away: the set hangs throughout, the breaker stays closed, and a read
    # that waited behind the set would wait past run_bounded's limit.
    engine, backend = engine_with_store(
        make_engine, PrefetchPolicy.WAIT_COMPLETE, io_timeout_s=240,
        prefetch_timeout_max=240,
    )
    ids = prompt(31)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    gate = backend.stall("set")
    try:
        run_bounded(engine, prompt(32))  # its backup hangs in set
        assert wait_until(lambda: backend.stalled_pages("set"), SETTLE_S), (
            "the backup never started"
        )
        began = time.monotonic()
        warm = run_bounded(engine, ids)
        assert time.monotonic() - began < MARGIN_S
        assert warm.last.cached_tokens.storage == (PROMPT - 1) // 16 * 16
        assert warm.token_ids == cold.token_ids
    finally:
        gate.set()
    until(engine, lambda: engine.cache.storage is not None
          and engine.cache.storage.controller.num_outstanding == 0, "the backup")
    engine.check_integrity()
