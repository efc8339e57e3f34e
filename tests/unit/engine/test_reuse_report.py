"""The ReuseAdvisor's admission side and its report, with the real planner: what a host hit
is acquired up to, what the report says the request did, and the actual time it gets once
the first token came (``ReuseTrack.final_report``).

The cache and the request are stand-ins holding only what the advisor reads (the page
size, the policy; the prompt's length, its retractions and track); the costs are a fixed
snapshot given as under tensor parallelism (``shared_costs``), so the live cost model is
not consulted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hicache.config import ReusePolicy
from hicache.engine.api import ReuseReport
from hicache.engine.cost_model import CostModel
from hicache.engine.reuse import ReuseAdvisor, ReuseTrack
from hicache.engine.reuse_plan import CostSnapshot, Decision, ReusePlan
from hicache.estimators import PrefillCoefficients
from hicache.radix.results import PrefixPeek

PAGE = 16
PROMPT = 321  # 20 whole pages and the last token
HOST = 20 * PAGE
# 1 ms a step and per token: the prompt computes in ~0.32 s.
LINEAR = PrefillCoefficients(1e-3, 1e-3, 0.0, 0.0)
CHEAP = CostSnapshot(LINEAR, None, load_latency_s=0.0, load_seconds_per_page=1e-4)
DEAR = CostSnapshot(LINEAR, None, load_latency_s=5.0, load_seconds_per_page=1e-4)
UNKNOWN = CostSnapshot(None, None)
NOW = 100.0


def advisor(costs: CostSnapshot, policy: ReusePolicy = ReusePolicy.COST) -> ReuseAdvisor:
    cache: Any = SimpleNamespace(page_size=PAGE, config=SimpleNamespace(reuse_policy=policy))
    reuse = ReuseAdvisor(cache, CostModel(), clock=lambda: NOW)
    reuse.shared_costs = costs
    return reuse


def request(retractions: int = 0) -> Any:
    return SimpleNamespace(seq_len=PROMPT, num_retractions=retractions, reuse_track=None)


def host_hit(device_pages: int = 0, host_pages: int = HOST // PAGE) -> PrefixPeek:
    return PrefixPeek(device_pages, host_pages, 0, PAGE)


def admit(reuse: ReuseAdvisor, req: Any, peek: PrefixPeek) -> tuple[int | None, ReuseReport]:
    """Acquire as the scheduler does (the limit, or all the host hit), then report."""
    limit, plan, costs = reuse.acquire_limit(req, peek, decode_rows=0)
    end = peek.num_device_tokens + peek.num_host_tokens
    loaded = (end if limit is None else limit) - peek.num_device_tokens
    reuse.admitted(req, peek.num_device_tokens, loaded, plan, costs)
    assert req.reuse_track is not None and req.reuse_track.report is not None
    report: ReuseReport = req.reuse_track.report
    return limit, report


def test_a_dear_host_hit_is_acquired_up_to_the_device_hit_and_reported_recomputed() -> None:
    reuse, req = advisor(DEAR), request()
    limit, report = admit(reuse, req, host_hit())
    assert limit == 0  # nothing of the host hit is loaded
    assert report.decision == Decision.RECOMPUTE.value
    assert (report.cached_tokens, report.loaded_tokens, report.recomputed_tokens) == (0, 0, HOST)
    # Priced as computed: every token of the prompt, no load.
    assert report.predicted_s == pytest.approx(DEAR.prefill_s(PROMPT, 0, 0))
    assert report.predicted_recompute_s == pytest.approx(report.predicted_s)
    assert report.predicted_load_s is not None and report.predicted_load_s > 5.0
    assert report.waited_s is None and report.predicted_wait_s is None  # no L3
    assert report.actual_s is None  # until the first token
    assert req.reuse_track.admitted_at == NOW


def test_a_cheap_host_hit_is_loaded_whole_and_priced_as_loaded() -> None:
    reuse, req = advisor(CHEAP), request()
    limit, report = admit(reuse, req, host_hit(device_pages=4, host_pages=16))
    assert limit == HOST  # the plan's boundary: the end of the host hit
    assert report.decision == Decision.LOAD.value
    assert (report.cached_tokens, report.loaded_tokens, report.recomputed_tokens) == (
        HOST, HOST - 4 * PAGE, 0)
    expected = CHEAP.load_s(16)
    tail = CHEAP.prefill_s(PROMPT - HOST, HOST, 0)
    assert expected is not None and tail is not None
    assert report.predicted_s == pytest.approx(expected + tail)


def test_policy_load_acquires_everything_a_dear_hit_offers_and_still_prices_it() -> None:
    reuse, req = advisor(DEAR, ReusePolicy.LOAD), request()
    limit, report = admit(reuse, req, host_hit())
    assert limit is None  # no limit: the tiers' default
    assert report.decision == Decision.LOAD.value
    assert report.loaded_tokens == HOST and report.recomputed_tokens == 0
    assert report.predicted_s is not None and report.predicted_s > 5.0
    assert report.predicted_recompute_s is not None
    assert report.predicted_recompute_s < report.predicted_s  # it was known to lose


def test_unknown_costs_load_everything_unpriced() -> None:
    reuse, req = advisor(UNKNOWN), request()
    limit, report = admit(reuse, req, host_hit())
    assert limit is None
    assert report.decision == Decision.UNPRICED.value
    assert report.loaded_tokens == HOST
    assert report.predicted_s is None and report.predicted_load_s is None
    assert report.predicted_recompute_s is None


def test_no_choice_without_a_host_hit_or_on_a_retracted_request() -> None:
    reuse = advisor(CHEAP)
    cold = request()
    assert reuse.acquire_limit(cold, host_hit(device_pages=20, host_pages=0), 0) == (
        None, None, None)
    assert cold.reuse_track is None  # no report: nothing was offered beyond the device
    assert reuse.acquire_limit(request(), None, 0) == (None, None, None)  # no prefix cache
    retracted = request(retractions=1)
    assert reuse.acquire_limit(retracted, host_hit(), 0) == (None, None, None)


def test_a_readmission_keeps_the_first_report() -> None:
    reuse, req = advisor(DEAR), request()
    _, first = admit(reuse, req, host_hit())
    reuse.admitted(req, HOST, 0, None, None)  # as if readmitted with all of it on the device
    assert req.reuse_track.report is first


def report(**fields: Any) -> ReuseReport:
    return ReuseReport(decision="recompute", cached_tokens=0, loaded_tokens=0,
                       recomputed_tokens=HOST, predicted_s=0.3, **fields)


def test_final_report_fills_the_time_from_admission_to_the_first_token() -> None:
    track = ReuseTrack(report=report(), admitted_at=NOW)
    final = track.final_report(NOW + 0.25)
    assert final is not None and final.actual_s == pytest.approx(0.25)
    assert final == report(actual_s=final.actual_s)  # nothing else changes
    assert track.report is not None and track.report.actual_s is None  # the track's stays


def test_final_report_without_a_report_or_a_first_token() -> None:
    assert ReuseTrack().final_report(NOW) is None  # never admitted (aborted while waiting)
    track = ReuseTrack(report=report(), admitted_at=NOW)
    assert track.final_report(None) is track.report  # ended before its first token


def test_the_report_takes_the_first_l3_plan_as_its_prediction_of_the_pure_ways() -> None:
    # A plan made while the request's L3 prefetch was in flight is what the report quotes
    # for load and recompute, and for the wait it expected; waited_s runs from it.
    first = ReusePlan(cached_tokens=0, decision=Decision.RECOMPUTE, predicted_s=0.3,
                      wait_s=0.0, load_all_s=2.0, recompute_s=0.3)
    reuse, req = advisor(CHEAP), request()
    req.reuse_track = ReuseTrack(first=first, first_at=NOW - 0.1, available_end=HOST,
                                 offered=True)
    reuse.admitted(req, 0, 0, None, CHEAP)
    made = req.reuse_track.report
    assert made is not None and made.decision == Decision.RECOMPUTE.value
    assert (made.predicted_load_s, made.predicted_recompute_s) == (2.0, 0.3)
    assert made.predicted_wait_s == 0.0
    assert made.waited_s == pytest.approx(0.1)
    assert made.recomputed_tokens == HOST
