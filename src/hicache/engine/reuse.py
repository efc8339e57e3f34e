"""The scheduler's load-or-recompute choice, per request, before admission.

``reuse_plan.py`` prices the choice; this applies it where the scheduler admits:

- a request held for its L3 prefetch (the prefetch policy says wait) is held only
  while the plan needs pages still to land: once the pages that have landed, plus
  computing the rest, are predicted faster than waiting for the others, the
  prefetch is cut there (``Prefetcher.settled``). The ``timeout``, ``best_effort``
  and ``wait_complete`` policies stay upper bounds: a request is never held longer
  than they say, only released sooner;
- at admission, the host hit (the landed L3 pages among it) is acquired only up to
  the plan's page boundary; the pages past it are computed again and join the tree
  as usual (the tree adopts them where it holds those tokens on the host only).

Each such request gets a ``ReuseTrack``; its ``ReuseReport`` (decision, predicted
and actual times) reaches the request's last output and from there the server's
meta_info and /metrics.

Costs are the live cost model's, frozen per decision (``CostSnapshot``). Under
tensor parallelism every rank decides from rank 0's snapshot, sent with each tick
(``replication.py`` sets ``shared_costs``), and from the agreed L3 progress, so the
ranks choose alike. With ``--hicache-reuse-policy load`` nothing is cut and every
page is loaded, as before the choice existed; the report is still made.

Runs on the scheduler thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import ReusePolicy
from hicache.engine.api import ReuseReport
from hicache.engine.cost_model import CostModel
from hicache.engine.request import Req
from hicache.engine.reuse_plan import (
    CostSnapshot,
    Decision,
    ReusePlan,
    ReuseSituation,
    decision_for,
    plan_reuse,
    price,
)
from hicache.radix.results import PrefixPeek


@dataclass
class ReuseTrack:
    """A request's choice as it forms: the first L3 plan, then the report at admission."""

    first: ReusePlan | None = None  # the first plan made while its L3 prefetch was in flight
    first_at: float | None = None  # when L3's lookup was first priced
    available_end: int = 0  # the end of what the tiers offered (device + host + L3 found)
    report: ReuseReport | None = None  # made at admission
    admitted_at: float = 0.0
    # A tier beyond the device offered part of the prompt: the request gets a report.
    offered: bool = False
    # The last wait decision and what it was made from: a request held for its prefetch is
    # asked every tick, and pricing every page boundary again (under a millisecond) only
    # pays when a page has landed or the lookup answered.
    memo: tuple[tuple[int, ...], bool] | None = None

    def final_report(self, first_token_at: float | None) -> ReuseReport | None:
        """The report with the actual time from admission to the first token filled in."""
        report = self.report
        if report is None or first_token_at is None:
            return report
        return dataclasses.replace(report, actual_s=first_token_at - self.admitted_at)


class ReuseAdvisor:
    def __init__(
        self, cache: HierarchicalCache, cost_model: CostModel, clock: Callable[[], float]
    ) -> None:
        self.cache = cache
        self.cost_model = cost_model
        self.clock = clock
        # Under tensor parallelism: rank 0's costs for this tick (every rank decides alike).
        self.shared_costs: CostSnapshot | None = None
        # --hicache-reuse-policy; a benchmark may switch it between requests (scheduler
        # thread, through ``Scheduler.call``) to time each way side by side.
        self.policy: ReusePolicy = cache.config.reuse_policy

    def local_costs(self) -> CostSnapshot:
        storage = self.cache.storage
        return self.cost_model.snapshot(storage.read_time if storage is not None else None)

    def costs(self) -> CostSnapshot:
        return self.shared_costs if self.shared_costs is not None else self.local_costs()

    def should_wait(self, req: Req, decode_rows: int) -> bool:
        """``req``'s prefetch policy would hold it for L3 pages still coming: hold it only
        while the plan needs them (True), else cut the prefetch where it stands (False)."""
        handle = req.prefetch
        assert handle is not None
        if self.policy is ReusePolicy.LOAD:
            return True  # the policy alone decides, as before the choice existed
        cache = self.cache
        found = handle.num_found_tokens
        peek = cache.peek(req.match_key(), req.request.extra_key)
        # The prefetch continues the local match it started from (its anchor is protected).
        host_end = max(handle.start_page * cache.page_size, peek.num_device_tokens)
        situation = ReuseSituation(
            prompt_tokens=req.seq_len, page_size=cache.page_size,
            device_tokens=peek.num_device_tokens, host_tokens=host_end - peek.num_device_tokens,
            landed_tokens=min(cache.prefetch_landed_tokens(handle), max(found, 0)),
            found_tokens=found if found >= 0 else handle.num_requested_tokens,
            decode_rows=decode_rows,
        )
        track = self.track(req)
        key = (found, situation.landed_tokens, host_end, situation.device_tokens, decode_rows)
        if track.memo is not None and track.memo[0] == key:
            return track.memo[1]
        plan = plan_reuse(situation, self.costs())
        wait = plan is None or plan.waits(situation)
        track.memo = (key, wait)
        # While the lookup has not answered, the plan priced the best it could bring
        # (every page asked for, in one read): computing the prompt may still beat even
        # that (a slow store's round trip against a short prompt). Not reported: what L3
        # holds is unknown, and a cold prompt (the usual case) offered nothing.
        if found < 0:
            return wait
        if found >= 0 and situation.cached_end <= situation.device_tokens:
            # A miss with no host hit: nothing to choose, so no report. The store's thread
            # sets what it found before the scheduler applies its answer: a miss may be
            # seen here for a moment, while the prefetch is not complete yet.
            return True  # settled by the policy once the answer is applied
        track.offered = True
        if track.first_at is None:
            track.first, track.first_at = plan, self.clock()
        track.available_end = max(track.available_end, situation.cached_end)
        return wait

    def acquire_limit(
        self, req: Req, peek: PrefixPeek | None, decode_rows: int
    ) -> tuple[int | None, ReusePlan | None, CostSnapshot | None]:
        """Tokens of ``req.match_tokens()`` to acquire (None: all), with the plan and the
        costs it was priced with. Only a first admission with a host hit (or an L3
        prefetch behind it) chooses; a retracted request resumes from all it finds."""
        if peek is None or req.num_retractions:
            return None, None, None
        track = req.reuse_track
        if peek.num_host_tokens == 0 and (track is None or not track.offered):
            return None, None, None
        costs = self.costs()
        situation = ReuseSituation(
            prompt_tokens=req.seq_len, page_size=peek.page_size,
            device_tokens=peek.num_device_tokens, host_tokens=peek.num_host_tokens,
            decode_rows=decode_rows,
        )
        plan = plan_reuse(situation, costs)
        track = self.track(req)
        track.offered = True
        track.available_end = max(track.available_end, situation.host_end)
        if plan is None or self.policy is ReusePolicy.LOAD:
            return None, plan, costs
        return plan.cached_tokens, plan, costs

    def admitted(
        self, req: Req, device_tokens: int, loaded_tokens: int, plan: ReusePlan | None,
        costs: CostSnapshot | None, decode_rows: int = 0,
    ) -> None:
        """Record what ``req`` was admitted with, after its acquire: ``loaded_tokens`` past
        its ``device_tokens`` came from the host tier (L3's landed pages among them)."""
        track = req.reuse_track
        if track is None or not track.offered or track.report is not None:
            return
        cached = device_tokens + loaded_tokens
        predicted = None
        if costs is not None:
            situation = ReuseSituation(req.seq_len, self.cache.page_size, device_tokens,
                                       host_tokens=loaded_tokens, decode_rows=decode_rows)
            priced = price(situation, costs, cached)
            predicted = None if priced is None else priced[0]
        first = track.first if track.first is not None else plan
        if first is None and self.policy is ReusePolicy.COST:
            decision = Decision.UNPRICED
        else:
            decision = decision_for(cached, device_tokens, max(track.available_end, cached))
        now = self.clock()
        track.report = ReuseReport(
            decision=decision.value, cached_tokens=cached, loaded_tokens=loaded_tokens,
            recomputed_tokens=max(track.available_end - cached, 0), predicted_s=predicted,
            predicted_load_s=None if first is None else first.load_all_s,
            predicted_recompute_s=None if first is None else first.recompute_s,
            predicted_wait_s=None if track.first is None else track.first.wait_s,
            waited_s=None if track.first_at is None else now - track.first_at,
        )
        track.admitted_at = now

    @staticmethod
    def track(req: Req) -> ReuseTrack:
        if req.reuse_track is None:
            req.reuse_track = ReuseTrack()
        return req.reuse_track
