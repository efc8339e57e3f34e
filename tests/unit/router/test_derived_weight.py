"""tier_aware's derived overlap weight (``--overlap-weight auto``): ``1 + prefilling +
usage`` per worker, from the router's ledger and the worker's cache usage; and the
predicted TTFT every tier_aware decision reports beside the measured one."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from hicache.engine.reuse_plan import CostSnapshot
from hicache.estimators import PrefillCoefficients
from hicache.events.messages import MEDIUM_CPU, BlockStored, KVEventBatch
from hicache.router.index import PageIndex
from hicache.router.live_costs import cache_usage
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.settings import SettingsError, add_arguments, settings_from_args
from hicache.router.ttft_model import predict_for
from hicache.router.types import RouteDecision, RouteRequest, TierOverlap, WorkerLoad
from tests.tier_aware_route import route

PAGE = 16
AUTO = ScoringConfig(overlap_weight=None, load_term="pending_prefill")


def _route(index: PageIndex, config: ScoringConfig, pages: list[int],
           workers: list[WorkerLoad]) -> RouteDecision:
    return route(index, config, pages, workers, PAGE)


def _host_holds(index: PageIndex, worker: str, pages: list[int]) -> None:
    event = BlockStored(pages, None, [0] * (len(pages) * PAGE), PAGE, None, MEDIUM_CPU)
    index.apply(worker, KVEventBatch(ts=0.0, events=[event]))


def test_the_weight_is_one_plus_the_queue_plus_the_cache_usage() -> None:
    index = PageIndex()
    workers = [
        WorkerLoad("A", prefilling_requests=2, cache_usage=0.5),
        WorkerLoad("B", prefilling_requests=0, cache_usage=None),  # not probed: taken as full
    ]
    decision = _route(index, AUTO, [1, 2, 3, 4], workers)
    # Cold everywhere: 4 pages each; A weighs them 1 + 2 + 0.5, B 1 + 0 + 1.
    assert decision.logits == {"A": pytest.approx(4 * 3.5), "B": pytest.approx(4 * 2.0)}
    assert decision.worker == "B"
    assert decision.overlap_weight == pytest.approx(2.0)


def test_a_busy_worker_holding_the_prefix_keeps_it_where_an_idle_one_would_lose_it() -> None:
    # A's host holds 6 of the request's 8 pages (a host page saves 0.9 of one); A has 6
    # pages of prefill pending, B none. Only the queues and caches differ between the cases.
    pages = list(range(1, 9))
    at_a = 8 - 6 * 0.9  # A recomputes 2.6 pages
    idle_caches = [
        WorkerLoad("A", pending_prefill_pages=6.0, prefilling_requests=0, cache_usage=0.0),
        WorkerLoad("B", pending_prefill_pages=0.0, prefilling_requests=0, cache_usage=0.0),
    ]
    index = PageIndex()
    _host_holds(index, "A", pages[:6])
    # Nothing queued, caches empty: the weight is 1 on both; 6 + 2.6 > 8, B wins.
    idle = _route(index, AUTO, pages, idle_caches)
    assert idle.logits == {"A": pytest.approx(6 + at_a), "B": pytest.approx(8.0)}
    assert idle.worker == "B"
    # Two requests waiting at each and full caches: each recomputed page also delays those
    # behind it and evicts a cached one; 6 + 4 * 2.6 < 4 * 8, A wins.
    busy = [
        WorkerLoad("A", pending_prefill_pages=6.0, prefilling_requests=2, cache_usage=1.0),
        WorkerLoad("B", pending_prefill_pages=0.0, prefilling_requests=2, cache_usage=1.0),
    ]
    kept = _route(index, AUTO, pages, busy)
    assert kept.logits == {"A": pytest.approx(6 + 4 * at_a), "B": pytest.approx(4 * 8.0)}
    assert kept.worker == "A"
    assert kept.overlap_weight == pytest.approx(4.0)


def test_a_given_weight_ignores_the_queue_and_the_cache() -> None:
    workers = [WorkerLoad("A", prefilling_requests=3, cache_usage=1.0), WorkerLoad("B")]
    decision = _route(PageIndex(), ScoringConfig(overlap_weight=2.0), [1, 2], workers)
    assert decision.logits == {"A": pytest.approx(4.0), "B": pytest.approx(4.0)}
    assert decision.overlap_weight == pytest.approx(2.0)


def test_cache_aware_without_a_weight_scores_with_dynamos_default() -> None:
    policy = build_policy("cache_aware", PageIndex(), None, ScoringConfig(overlap_weight=None))
    request = RouteRequest(page_hashes=[1, 2], prompt_tokens=2 * PAGE,
                           workers=[WorkerLoad("A", decode_blocks=3.0)], page_size=PAGE)
    decision = asyncio.run(policy.choose(request, list(range(2 * PAGE))))
    assert decision.logits == {"A": pytest.approx(1.0 * 2 + 3.0)}


def test_every_tier_aware_decision_reports_the_chosen_workers_predicted_ttft() -> None:
    measured = CostSnapshot(
        prefill=PrefillCoefficients(0.0, 1e-3, 0.0, 0.0), chunk_tokens=None,
        load_latency_s=0.0, load_seconds_per_page=1e-4, read_latency_s=0.0,
        read_seconds_per_page=5e-3)
    index = PageIndex()
    _host_holds(index, "A", [1, 2, 3])
    workers = [WorkerLoad("A", queued_prefill_s=0.25, costs=measured),
               WorkerLoad("B", costs=None)]  # B's figures come from A's (the median)
    decision = _route(index, ScoringConfig(), [1, 2, 3, 4], workers)
    assert decision.worker == "A"
    terms, filled = predict_for(
        RouteRequest(page_hashes=[1, 2, 3, 4], prompt_tokens=4 * PAGE, workers=workers,
                     page_size=PAGE),
        workers[0], workers, TierOverlap(gpu=0, host=3, external=3), None, PAGE)
    assert decision.predicted_ttft_s == pytest.approx(terms.ttft_s)
    assert decision.terms == pytest.approx(terms.as_dict())
    assert decision.fallbacks == filled == ()
    # Its queue and its own prefill: 3 host pages loaded, one page computed.
    assert terms.queue_s == pytest.approx(0.25)
    assert terms.own_s == pytest.approx(3 * 1e-4 + PAGE * 1e-3)
    assert decision.predicted_prefill_s == pytest.approx(terms.own_s)  # the ledger's entry


@pytest.mark.parametrize(("text", "usage"), [
    ("hicache_host_pool_usage 0.25\nhicache_device_pool_usage 0.9\n", 0.25),
    ("hicache_device_pool_usage 0.75\n", 0.75),
    ("hicache_host_pool_usage 1.5\n", 1.0),  # clamped
    ("hicache_host_pool_usage NaN\nhicache_device_pool_usage 0.5\n", 0.5),
    ("hicache_other 1\n", None),
    ("", None),
    (None, None),
])
def test_cache_usage_is_read_from_the_workers_metrics(text: str | None,
                                                      usage: float | None) -> None:
    assert cache_usage(text) == (None if usage is None else pytest.approx(usage))


def test_the_flag_takes_a_number_or_auto() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    url = ["--worker-urls", "http://127.0.0.1:1"]
    auto = settings_from_args(parser.parse_args([*url, "--overlap-weight", "auto"]))
    assert auto.overlap_weight is None
    fixed = settings_from_args(parser.parse_args([*url, "--overlap-weight", "2.5"]))
    assert fixed.overlap_weight == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args([*url, "--overlap-weight", "heavy"])
    with pytest.raises(SettingsError, match="--overlap-weight"):
        settings_from_args(parser.parse_args([*url, "--overlap-weight", "-1"]))
