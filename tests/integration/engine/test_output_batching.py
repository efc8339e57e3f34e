"""A step's outputs reach each event loop in one hand-off, not one per request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect, make_engine_fixture
from tests.integration.engine.test_engine_scheduling import greedy, prompt

__all__ = ["make_engine_fixture"]


def test_one_event_loop_callback_per_step_for_a_batch(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine("--page-size", "4")
    requests = [greedy(prompt(60 + i, 12), n=16) for i in range(6)]
    handoffs: list[int] = []

    async def all_of() -> list[Run]:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            handoffs.append(1)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            return list(await asyncio.gather(*(collect(engine, r) for r in requests)))
        finally:
            loop.call_soon_threadsafe = original  # type: ignore[method-assign]

    steps_before = engine.scheduler.counters.num_steps
    results = asyncio.run(all_of())
    steps = engine.scheduler.counters.num_steps - steps_before
    outputs = sum(len(r.outputs) for r in results)
    assert all(len(r.token_ids) == 16 for r in results)
    assert outputs >= 6 * 16  # one output per token (the final may carry the last)
    # One hand-off per step that produced outputs (a few more for asyncio's own use).
    assert len(handoffs) <= steps + 3, (len(handoffs), steps, outputs)
    assert len(handoffs) * 3 < outputs
