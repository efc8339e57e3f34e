"""A request's L3 lookup does not cost it a forward: the admission round that posts the
lookup waits a little for the answer (``prefetcher.LOOKUP_WAIT_S``), so a cold prompt that
arrived during a forward joins the next one; a lookup that hangs holds its own request
only, never the scheduler.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from hicache.engine import prefetcher
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.engine.request import Req
from hicache.storage.config import PrefetchPolicy
from tests.engine_helpers import collect, on_scheduler, run
from tests.integration.engine.test_engine_l3_faults import engine_with_store, prompt
from tests.storage_reference import MemoryBackend
from tests.waiting import wait_until_async

WAIT_S = 60.0
POLL_S = 0.01
LONG_TOKENS = 1500  # the request running beside: outlasts every check here


def greedy(ids: list[int], n: int = 8) -> GenerateRequest:
    return GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=n, temperature=0.0,
                                                      ignore_eos=True))


@dataclass
class Steps:
    """The scheduler's forwards, counted, and at which count each prompt arrived and was
    admitted (all on the scheduler thread)."""

    forwards: int = 0
    arrived: dict[tuple[int, ...], int] = field(default_factory=dict)
    admitted: dict[tuple[int, ...], int] = field(default_factory=dict)


def count_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Steps:
    sched = engine.scheduler
    steps = Steps()
    forward_step, arrive, start = sched.forward_step, sched.lifecycle.arrive, sched._start

    def counted_forward() -> int:
        steps.forwards += 1
        return forward_step()

    def noted_arrival(req: Req) -> None:
        steps.arrived[req.request.input_ids] = steps.forwards
        arrive(req)

    def noted_start(req: Req) -> bool:
        started = start(req)
        if started:
            steps.admitted.setdefault(req.request.input_ids, steps.forwards)
        return started

    def install() -> None:
        monkeypatch.setattr(sched, "forward_step", counted_forward)
        monkeypatch.setattr(sched.lifecycle, "arrive", noted_arrival)
        monkeypatch.setattr(sched, "_start", noted_start)

    on_scheduler(engine, install)
    return steps


class GatedLookups(MemoryBackend):
    """Lookups (``exists``) hang while ``gate`` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def exists(self, keys: Sequence[bytes]) -> int:
        self.gate.wait()
        return super().exists(keys)


def with_store(make_engine: Callable[..., Engine], backend: MemoryBackend) -> Engine:
    """An engine whose requests wait for what L3 may hold (reuse policy ``load``: the cost
    model might find these short prompts cheaper to compute than any read) and whose
    prefetch deadline is far off: only the lookup's answer lets a request start."""
    engine, _ = engine_with_store(
        make_engine, PrefetchPolicy.TIMEOUT, flags=("--hicache-reuse-policy", "load"),
        backend=backend, prefetch_timeout_base=WAIT_S, prefetch_timeout_max=WAIT_S,
    )
    return engine


async def beside_a_long_request(
    engine: Engine, ids: list[int], until: Callable[[], bool] = lambda: True,
    running: Callable[[], Any] = lambda: None, before: Callable[[], Any] = lambda: None,
) -> Any:
    """Send ``ids`` while a long request decodes (``running`` called once it does); once
    ``until`` holds, call ``before``, wait for the answer and end the long request;
    returns the answer, collected (``tests.engine_helpers.collect``)."""
    long_stream = engine.generate(greedy(prompt(99), n=LONG_TOKENS))
    await anext(long_stream)  # it runs: every step from now is a forward
    running()
    answer = asyncio.ensure_future(collect(engine, greedy(ids)))
    assert await wait_until_async(until, WAIT_S, POLL_S)
    before()
    got = await asyncio.wait_for(answer, WAIT_S)
    await long_stream.aclose()
    assert got.last.error is None
    return got


def held_for_forwards(engine: Engine, steps: Steps, key: tuple[int, ...],
                      forwards: int = 5) -> Callable[[], bool]:
    """Has the request ``key`` arrived and waited ``forwards`` forwards, not admitted,
    while the scheduler went on with the request running beside it?"""

    def held() -> bool:
        arrived = on_scheduler(engine, lambda: steps.arrived.get(key))
        return arrived is not None and key not in steps.admitted \
            and steps.forwards >= arrived + forwards

    return held


def test_a_cold_prompt_joins_the_forward_after_its_arrival(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow this machine is, the round waits for the answer (a long wait here):
    # the request is admitted before another forward runs.
    monkeypatch.setattr(prefetcher, "LOOKUP_WAIT_S", WAIT_S)
    backend = MemoryBackend()
    engine = with_store(make_engine, backend)
    ids = prompt(5)
    alone = run(engine, ids, ignore_eos=True).token_ids
    assert engine.flush_cache()
    backend.clear()  # cold in every tier
    steps = count_steps(engine, monkeypatch)
    got = asyncio.run(beside_a_long_request(engine, ids)).token_ids
    key = tuple(ids)
    assert steps.forwards > steps.arrived[key] > 0, steps  # it arrived beside the other
    assert steps.admitted[key] == steps.arrived[key], steps
    assert got == alone


def test_a_hanging_lookup_holds_its_request_only(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = GatedLookups()
    engine = with_store(make_engine, backend)
    ids = prompt(6)
    alone = run(engine, ids, ignore_eos=True).token_ids
    assert engine.flush_cache()
    backend.clear()
    steps = count_steps(engine, monkeypatch)
    # The scheduler goes on with the running request while this one's lookup hangs.
    got = asyncio.run(beside_a_long_request(
        engine, ids, held_for_forwards(engine, steps, tuple(ids)), running=backend.gate.clear,
        before=backend.gate.set,
    ))
    assert got.token_ids == alone
