"""A request whose prefix L3 holds does not sit out a forward for its read: the admission
round that holds it for pages still being read waits for them where that pays
(``prefetcher.read_wait_s``), so it joins the next forward; a read that hangs, or one the
live read time says is slower than the wait, holds its own request only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from hicache.engine import prefetcher, scheduler
from hicache.engine.engine import Engine
from hicache.storage.bandwidth import ReadTimeEstimate
from tests.engine_helpers import on_scheduler, run
from tests.integration.engine.test_engine_l3_faults import prompt
from tests.integration.engine.test_engine_l3_lookup_wait import (
    WAIT_S,
    beside_a_long_request,
    count_steps,
    held_for_forwards,
    with_store,
)
from tests.storage_reference import MemoryBackend


def in_l3(make_engine: Callable[..., Engine], seed: int) -> tuple[Engine, MemoryBackend,
                                                               list[int], list[int]]:
    """An engine over an in-memory L3 holding prompt ``seed``'s pages and nothing else
    (device and host flushed), the prompt, and its answer computed cold."""
    backend = MemoryBackend()
    engine = with_store(make_engine, backend)
    ids = prompt(seed)
    alone = run(engine, ids, ignore_eos=True).token_ids
    assert engine.flush_cache()
    assert backend.store.pages  # backed up
    return engine, backend, ids, alone


def test_a_prompt_read_from_l3_joins_the_forward_after_its_arrival(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow this machine is, the round waits for the lookup and the read.
    monkeypatch.setattr(prefetcher, "LOOKUP_WAIT_S", WAIT_S)
    monkeypatch.setattr(scheduler, "read_wait_s", lambda *_: WAIT_S)
    engine, _, ids, alone = in_l3(make_engine, 7)
    steps = count_steps(engine, monkeypatch)
    got = asyncio.run(beside_a_long_request(engine, ids))
    key = tuple(ids)
    assert steps.forwards > steps.arrived[key] > 0, steps  # it arrived beside the other
    assert steps.admitted[key] == steps.arrived[key], steps
    assert got.last.cached_tokens.storage > 0  # its prefix came from L3
    assert got.token_ids == alone
    engine.check_integrity()


@pytest.mark.parametrize("slow", ["hangs", "predicted_slow"])
def test_a_read_not_worth_waiting_for_holds_its_request_only(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, slow: str,
) -> None:
    monkeypatch.setattr(prefetcher, "LOOKUP_WAIT_S", WAIT_S)
    # hangs: a short wait, spent each round, then the forward goes on. predicted_slow: a
    # wait as long as the test's, which the live read time says this read would outlast,
    # so no round waits at all (were one to, no forward would run for a minute).
    wait_s = 0.02 if slow == "hangs" else WAIT_S
    monkeypatch.setattr(scheduler, "read_wait_s", lambda *_: wait_s)
    engine, backend, ids, alone = in_l3(make_engine, 8)
    if slow == "predicted_slow":
        def slow_reads() -> None:
            storage = engine.cache.storage
            assert storage is not None
            estimate = ReadTimeEstimate(storage.read_time.page_size,
                                        page_bytes=storage.read_time.page_bytes)
            for pages in (1, 2, 4, 8):
                estimate.observe(pages, 100.0 * pages)  # 100 s a page
            predicted = estimate.predict_read(1)
            assert predicted is not None and predicted > WAIT_S
            storage.read_time = estimate
        on_scheduler(engine, slow_reads)
    gate = backend.stall("get")
    steps = count_steps(engine, monkeypatch)
    # The scheduler goes on with the running request while this one's read hangs.
    held = held_for_forwards(engine, steps, tuple(ids))
    got = asyncio.run(beside_a_long_request(engine, ids, held, before=gate.set))
    assert got.token_ids == alone
    engine.check_integrity()
