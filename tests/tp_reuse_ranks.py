"""What each rank does in the tensor-parallel load-or-recompute oracle test (spawned ranks
import this module, not the test).

``run_forced_splits`` builds a rank's engine without its scheduler thread, installs the
same forced advisor on every rank (``tests/forced_reuse.py``), makes the controller read
L3 a few pages per call (so a prefetch lands in steps a cut falls between) and drives
the scenario as ``tp_engine_ranks`` does: rank 0 ticks the replicated scheduler, the
followers replay it. It returns the rank's ``RankResult`` with each request's
``ReuseReport`` decision, cached and loaded tokens, and the landed count the prefetch
was cut at.
"""

from __future__ import annotations

from dataclasses import dataclass

import hicache.storage.controller as storage_controller
from hicache.distributed.group import TPGroup
from hicache.engine.build import build_engine
from hicache.engine.cache_ops import CACHE_OPS
from tests.forced_reuse import force_reuse
from tests.tp_engine_ranks import RankResult, Scenario, _drive


@dataclass(frozen=True)
class ForcedSplits:
    scenario: Scenario
    boundary: int  # the host split's forced boundary (tokens)
    boundary_rids: frozenset[str]  # the requests it applies to
    cut_tokens: int  # the L3 prefetch is cut once this many tokens have landed
    read_batch_pages: int  # pages per L3 read


@dataclass(frozen=True)
class ForcedSplitsResult:
    ranks: RankResult
    reports: dict[str, tuple[str, int, int]]  # rid -> (decision, cached, loaded tokens)
    cut_landed: int | None


def run_forced_splits(tp: TPGroup, case: ForcedSplits) -> ForcedSplitsResult:
    # This rank's process only: L3 reads of a few pages each (the controller's batch).
    storage_controller.MAX_BATCH_PAGES = case.read_batch_pages  # type: ignore[attr-defined]
    engine = build_engine(case.scenario.config, tp, start=False)
    try:
        forced = force_reuse(engine, case.boundary, case.cut_tokens, threaded=False,
                             boundary_rids=case.boundary_rids)
        result = _drive(engine, tp, case.scenario)
        cache = engine.cache
        result.tree_device_pages = sorted(int(p) for p in cache.tree.device_page_ids())
        result.tree_host_pages = sorted(int(p) for p in cache.tree.host_page_ids())
        CACHE_OPS["check_integrity"](engine.scheduler)  # the group has stopped: rank-local
        reports = {
            rid: (r.decision, r.cached_tokens, r.loaded_tokens)
            for rid, r in forced.reports.items()
        }
        return ForcedSplitsResult(result, reports, forced.cut_landed)
    finally:
        engine.shutdown()
