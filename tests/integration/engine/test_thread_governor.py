"""The thread governor: all cores while other work leaves them idle, one fewer while it
does not, with a gap between the two thresholds; /proc/stat read per CPU."""

from __future__ import annotations

import os

import pytest

from hicache.engine.build import build_engine
from hicache.engine.config import EngineConfig, ModelLoadConfig, RuntimeConfig, SchedulingConfig
from hicache.engine.thread_governor import ThreadGovernor, busy_seconds
from hicache.engine.threads import adaptive_range


class FakeMachine:
    """Busy seconds that grow as told: ``others`` and ``ours`` cores of work per second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.machine = 0.0
        self.own = 0.0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.now += seconds
        self.machine += (others + ours) * seconds
        self.own += ours * seconds


def _governor(machine: FakeMachine) -> ThreadGovernor:
    return ThreadGovernor(1, 2, cpus=[0, 1], interval_s=1.0, clock=lambda: machine.now,
                          machine_busy=lambda: machine.machine, own_busy=lambda: machine.own)


def test_busy_and_idle_cores_move_the_count_with_a_gap() -> None:
    machine = FakeMachine()
    governor = _governor(machine)
    assert governor.threads == 2
    machine.run(0.5, others=2.0, ours=1.0)
    assert governor.tick() is None  # within the interval: not even read
    machine.run(0.6, others=2.0, ours=1.0)
    assert governor.tick() == 1 and governor.threads == 1
    assert governor.others_cores == pytest.approx(2.0)
    machine.run(1.0, others=0.45, ours=1.0)  # between the thresholds: stays
    assert governor.tick() is None and governor.threads == 1
    machine.run(1.0, others=0.1, ours=2.0)  # our own work never counts as others'
    assert governor.tick() == 2
    machine.run(1.0, others=0.45, ours=2.0)
    assert governor.tick() is None and governor.threads == 2
    machine.run(1.0, others=0.9, ours=1.5)
    assert governor.tick() == 1


def test_no_reading_changes_nothing() -> None:
    clock = [0.0]
    governor = ThreadGovernor(1, 2, cpus=[0], clock=lambda: clock[0],
                              machine_busy=lambda: None, own_busy=lambda: 0.0)
    clock[0] = 5.0
    assert governor.tick() is None and governor.threads == 2
    with pytest.raises(ValueError):
        ThreadGovernor(3, 2, cpus=[0])


def test_proc_stat_is_read_per_cpu() -> None:
    text = (
        "cpu  1000 0 1000 9000 100 0 0 0 0 0\n"
        "cpu0 100 0 100 800 50 0 0 0 0 0\n"
        "cpu1 300 10 90 500 50 20 30 0 0 0\n"
        "intr 12345\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds([0], text) == pytest.approx(200 / tick)
    assert busy_seconds([1], text) == pytest.approx(450 / tick)
    assert busy_seconds([0, 1], text) == pytest.approx(650 / tick)
    real = busy_seconds(sorted(os.sched_getaffinity(0)))
    assert real is not None and real > 0


def test_the_engine_governs_its_threads_only_when_not_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert adaptive_range(4, "cpu") is None and adaptive_range(None, "cuda") is None
    if cores < 2:
        assert adaptive_range(None, "cpu") is None
        return
    assert adaptive_range(None, "cpu") == (cores - 1, cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert adaptive_range(None, "cpu") is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    base = EngineConfig(model=ModelLoadConfig(preset="tiny", device="cpu"),
                        scheduling=SchedulingConfig(max_total_tokens=512))
    engine = build_engine(base)
    try:
        assert engine.scheduler.governor is not None
        assert engine.metrics()["engine_torch_threads"] == cores
    finally:
        engine.shutdown()
    fixed = EngineConfig(model=base.model, scheduling=base.scheduling,
                         runtime=RuntimeConfig(num_threads=1))
    engine = build_engine(fixed)
    try:
        assert engine.scheduler.governor is None
        assert engine.metrics()["engine_torch_threads"] == 1
    finally:
        engine.shutdown()


def test_one_row_steps_run_on_the_low_count() -> None:
    machine = FakeMachine()
    governor = _governor(machine)
    assert governor.threads == 2
    assert governor.threads_for(1) == 1  # one request decoding: memory-bound
    assert governor.threads_for(2) == 2 and governor.threads_for(300) == 2
    machine.run(1.1, others=2.0, ours=1.0)
    assert governor.tick() == 1
    assert governor.threads_for(300) == 1
