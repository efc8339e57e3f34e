"""A load-or-recompute advisor whose choice a test forces (``ForcedReuse``).

The engine's advisor (``engine/reuse.py``) picks the page boundary a request starts
computing from by its live costs; the oracle tests need every boundary exercised
whatever those costs are. This double replaces only the two choices:

- ``acquire_limit``: the host hit is acquired up to ``boundary`` tokens (None: all
  of it), a page multiple at or past the device hit; with ``boundary_rids``, only for
  those requests (the others take all of it);
- ``should_wait``: a request held for its L3 prefetch waits until ``cut_tokens`` of it
  have landed, then the prefetch is cut there (None: it waits as the prefetch policy
  says). The landed count it cut at is kept in ``cut_landed``.

``admitted`` is the real one, so the request's ``ReuseReport`` (decision, cached and
loaded tokens) is what the engine would report for that choice; each is kept by rid in
``reports``. Under tensor parallelism every rank installs the same double, and the
landed count it reads is the one the ranks agreed on, so the ranks choose alike.

Imports quickly (no transformers): spawned tensor-parallel ranks import it.
"""

from __future__ import annotations

from hicache.engine.api import ReuseReport
from hicache.engine.engine import Engine
from hicache.engine.request import Req
from hicache.engine.reuse import ReuseAdvisor
from hicache.engine.reuse_plan import CostSnapshot, ReusePlan, ReuseSituation, decision_for, price
from hicache.radix.results import PrefixPeek


class ForcedReuse(ReuseAdvisor):
    """See the module docstring."""

    def __init__(
        self, real: ReuseAdvisor, boundary: int | None = None, cut_tokens: int | None = None,
        boundary_rids: frozenset[str] | None = None,
    ) -> None:
        super().__init__(real.cache, real.cost_model, real.clock)
        self.policy = real.policy
        self.boundary = boundary
        self.boundary_rids = boundary_rids
        self.cut_tokens = cut_tokens
        self.cut_landed: int | None = None  # tokens landed when the prefetch was cut
        self.reports: dict[str, ReuseReport] = {}

    def should_wait(self, req: Req, decode_rows: int) -> bool:
        handle = req.prefetch
        assert handle is not None
        found = handle.num_found_tokens
        if found < 0:
            return True  # the lookup has not answered yet
        track = self.track(req)
        track.offered = True
        host_end = max(handle.start_page * self.cache.page_size,
                       self.cache.peek(req.match_tokens(), req.request.extra_key).num_device_tokens)
        # What the tiers offer: the report names a cut inside it a split.
        track.available_end = max(track.available_end, host_end + found)
        landed = self.cache.prefetch_landed_tokens(handle)
        if self.cut_tokens is None or landed < self.cut_tokens:
            return True
        self.cut_landed = landed
        return False

    def acquire_limit(
        self, req: Req, peek: PrefixPeek | None, decode_rows: int
    ) -> tuple[int | None, ReusePlan | None, CostSnapshot | None]:
        if peek is None or req.num_retractions:
            return None, None, None
        track = req.reuse_track
        if peek.num_host_tokens == 0 and (track is None or not track.offered):
            return None, None, None
        track = self.track(req)
        track.offered = True
        host_end = peek.num_device_tokens + peek.num_host_tokens
        track.available_end = max(track.available_end, host_end)
        boundary = self.boundary
        if self.boundary_rids is not None and req.rid not in self.boundary_rids:
            boundary = None
        cached = host_end if boundary is None else boundary
        assert cached % peek.page_size == 0 and cached >= peek.num_device_tokens, cached
        costs = self.costs()
        situation = ReuseSituation(req.seq_len, peek.page_size, peek.num_device_tokens,
                                   host_tokens=peek.num_host_tokens, decode_rows=decode_rows)

        def seconds(c: int) -> float:  # nan while a cost is unknown (a plan needs a number)
            priced = price(situation, costs, c)
            return float("nan") if priced is None else priced[0]

        plan = ReusePlan(
            cached_tokens=cached,
            decision=decision_for(cached, peek.num_device_tokens, track.available_end),
            predicted_s=seconds(min(cached, host_end)), wait_s=0.0,
            load_all_s=seconds(host_end), recompute_s=seconds(peek.num_device_tokens),
        )
        return (None if boundary is None else cached), plan, costs

    def admitted(
        self, req: Req, device_tokens: int, loaded_tokens: int, plan: ReusePlan | None,
        costs: CostSnapshot | None, decode_rows: int = 0,
    ) -> None:
        super().admitted(req, device_tokens, loaded_tokens, plan, costs, decode_rows)
        if req.reuse_track is not None and req.reuse_track.report is not None:
            self.reports.setdefault(req.rid, req.reuse_track.report)


def force_reuse(
    engine: Engine, boundary: int | None = None, cut_tokens: int | None = None,
    threaded: bool = True, boundary_rids: frozenset[str] | None = None,
) -> ForcedReuse:
    """Install a ``ForcedReuse`` as ``engine``'s advisor: on its scheduler thread when
    ``threaded`` (the advisor is read there, between steps), else directly (an engine a
    test ticks by hand). The prefetcher asks ``scheduler.reuse`` each time, so it
    follows."""
    scheduler = engine.scheduler
    forced = ForcedReuse(scheduler.reuse, boundary, cut_tokens, boundary_rids)

    def install() -> None:
        scheduler.reuse = forced

    if threaded:
        scheduler.call(install).result(timeout=60)
    else:
        install()
    return forced
