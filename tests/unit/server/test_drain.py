"""The drain's steps (``server/drain.py``) over a stand-in engine: once only; requests first,
those left at the deadline aborted with the drain's error; the L3 writing bounded by the same
deadline; nothing written without L3; ``on_done`` at the end in every case."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from hicache.server.drain import DEADLINE_ERROR, DrainCollector, Drainer, DrainPhase

WAIT_S = 60.0  # a guard against a hang


class FakeEngine:
    """Requests that end when told; an L3 drain that ends after ``steps`` steps (None: never)."""

    def __init__(self, attached: bool = True, steps: int | None = 2, busy: bool = False) -> None:
        self.attached = attached
        self.steps = steps
        self.busy = busy
        self.aborted: list[str] = []
        self.num_steps = 0

    def is_idle(self) -> bool:
        return not self.busy

    def abort_all(self, message: str) -> int:
        self.aborted.append(message)
        self.busy = False
        return 1

    def drain_l3_step(self) -> dict[str, Any]:
        self.num_steps += 1
        done = self.steps is not None and self.num_steps >= self.steps
        return {"pages_to_write": 10, "pages_written": 10 if done else 3,
                "pages_existing": 0, "pages_skipped": 0, "done": done}

    def l3_lacking_pages(self) -> int:
        return 10 if self.attached else 0

    def storage_status(self) -> dict[str, Any]:
        return {"attached": self.attached}


async def drain(engine: FakeEngine, rids: set[str] | None = None, timeout_s: float = 30.0,
                clock: Callable[[], float] = time.monotonic,
                ) -> tuple[Drainer, dict[str, Any] | None]:
    done = asyncio.Event()
    drainer = Drainer(engine, rids if rids is not None else set(), timeout_s, on_done=done.set,
                      clock=clock)
    plan = await drainer.begin("test")
    assert drainer.draining
    await asyncio.wait_for(done.wait(), WAIT_S)
    return drainer, plan


def test_an_idle_worker_writes_what_l3_lacks_then_is_done() -> None:
    engine = FakeEngine()
    drainer, plan = asyncio.run(drain(engine))
    assert plan is not None and plan["pages_l3_lacks"] == 10 and plan["l3_attached"]
    assert drainer.phase is DrainPhase.DONE and engine.aborted == []
    assert (drainer.pages_written, drainer.pages_to_write) == (10, 10)
    assert engine.num_steps == 2


def test_a_second_drain_is_refused() -> None:
    async def twice() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        drainer = Drainer(FakeEngine(steps=None), set(), timeout_s=0.2)
        first = await drainer.begin("first")
        second = await drainer.begin("second")
        assert drainer.task is not None
        await asyncio.wait_for(drainer.task, WAIT_S)
        return first, second

    first, second = asyncio.run(twice())
    assert first is not None and second is None


def test_requests_left_at_the_deadline_are_aborted_and_nothing_is_written() -> None:
    engine = FakeEngine(busy=True)
    drainer, plan = asyncio.run(drain(engine, rids={"a"}, timeout_s=0.2))
    assert plan is not None and plan["requests_in_flight"] == 1
    assert engine.aborted == [DEADLINE_ERROR]
    assert drainer.requests_aborted == 1
    assert engine.num_steps == 0  # the deadline bounds the writes too: none left to them


def test_writing_to_l3_stops_at_the_deadline() -> None:
    # The drain's clock moves only with the writes, a second a step: on the wall clock a
    # loaded machine could pass the deadline before the first step.
    now = [0.0]

    class SlowStore(FakeEngine):
        def drain_l3_step(self) -> dict[str, Any]:
            now[0] += 1.0
            return super().drain_l3_step()

    engine = SlowStore(steps=None)  # a store that never catches up
    drainer, _ = asyncio.run(drain(engine, timeout_s=2.5, clock=lambda: now[0]))
    assert drainer.phase is DrainPhase.DONE
    assert engine.num_steps == 3  # the one that passed the deadline is the last
    assert (drainer.pages_written, drainer.pages_to_write) == (3, 10)


def test_without_l3_nothing_is_written() -> None:
    engine = FakeEngine(attached=False)
    drainer, plan = asyncio.run(drain(engine))
    assert plan is not None and plan["l3_attached"] is False and plan["pages_l3_lacks"] == 0
    assert drainer.phase is DrainPhase.DONE and engine.num_steps == 0


def test_an_engine_that_cannot_answer_still_lets_the_drain_end() -> None:
    class DeadEngine(FakeEngine):
        def storage_status(self) -> dict[str, Any]:
            raise RuntimeError("the engine process is gone")

        def is_idle(self) -> bool:
            raise RuntimeError("the engine process is gone")

    engine = DeadEngine()
    drainer, plan = asyncio.run(drain(engine))
    assert plan is not None and plan["l3_attached"] is False
    assert drainer.phase is DrainPhase.DONE and engine.num_steps == 0


def test_the_progress_is_exported() -> None:
    drainer, _ = asyncio.run(drain(FakeEngine()))
    values = {
        sample.name: sample.value
        for family in DrainCollector(drainer).collect() for sample in family.samples
    }
    assert values["hicache_drain_state"] == float(DrainPhase.DONE)
    assert values["hicache_drain_pages_written_total"] == 10
    assert values["hicache_drain_pages_to_write"] == 10
    assert values["hicache_drain_requests_aborted_total"] == 0


def test_a_negative_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="--drain-timeout-s"):
        Drainer(FakeEngine(), set(), timeout_s=-1)
