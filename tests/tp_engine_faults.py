"""A fault injected into one tensor-parallel rank of an ``EngineClient``: its scheduler
raises in a tick once a request runs, as a bug or a broken device would.

Rank 0 gets it through ``EngineClient``'s ``on_built``; a follower through its process
target (``raising_follower``, set in place of ``run_follower_process``). Both are here,
in a module that imports quickly, because the spawned ranks import them afresh.
"""

from __future__ import annotations

from typing import Any

from hicache.engine.engine_process import run_follower_process
from hicache.engine.scheduler import Scheduler

FAULT = "injected fault in a tick"


def raise_in_tick(engine: Any) -> None:
    """Make ``engine``'s scheduler raise in its first tick with a request running."""
    scheduler: Scheduler = engine.scheduler
    real = scheduler.schedule

    def schedule() -> bool:
        if scheduler.num_running:
            raise RuntimeError(FAULT)
        return real()

    scheduler.schedule = schedule  # type: ignore[method-assign]


def raising_follower(
    config: Any, rank: int, tp_init_method: str, log_level: int, start_report: Any = None,
    parent_pid: int | None = None,
) -> None:
    """``run_follower_process`` whose scheduler raises in a tick (``raise_in_tick``)."""
    real = Scheduler.schedule

    def schedule(self: Scheduler) -> bool:
        if self.running:
            raise RuntimeError(FAULT)
        return real(self)

    Scheduler.schedule = schedule  # type: ignore[method-assign]
    run_follower_process(config, rank, tp_init_method, log_level, start_report,
                         parent_pid=parent_pid)
