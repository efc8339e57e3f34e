"""Measured tier costs from what a worker reports, and the fallback to the defaults."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.engine.cost_model import REFERENCE_CONTEXTS
from hicache.engine.cost_model import REFERENCE_PAGES as ENGINE_REFERENCE_PAGES
from hicache.router.tier_costs import (
    MIN_PAGES,
    REFERENCE_CONTEXT,
    REFERENCE_PAGES,
    WorkerFigures,
    measured_tier_costs,
    tier_costs_from,
    worker_figures,
)
from hicache.router.types import TierCosts

PAGE = 16


def info(**counters: float) -> dict[str, Any]:
    return {"page_size": PAGE, "internal_states": [counters]}


# 1600 tokens in 0.1 s: 16,000 tokens/s, so recomputing a page takes 1 ms.
PREFILL = {"engine_num_prefill_step_tokens": 1600, "engine_prefill_step_seconds": 0.1}


def test_costs_are_each_tiers_time_over_recomputing() -> None:
    costs = measured_tier_costs(info(
        **PREFILL,
        cache_num_loaded_pages=100, cache_load_seconds=0.01,  # 0.1 ms a page
        storage_prefetch_pages_loaded=50, storage_prefetch_seconds=0.02,  # 0.4 ms a page
    ), None)
    assert costs.host == pytest.approx(0.1)
    assert costs.external == pytest.approx(0.4 + 0.1)  # read into the host, then loaded


def test_the_same_figures_read_from_prometheus_text() -> None:
    text = "\n".join([
        "# TYPE hicache_prefill_step_tokens counter",
        "hicache_prefill_step_tokens_total 1600.0",
        "# TYPE hicache_prefill_step_seconds counter",
        "hicache_prefill_step_seconds_total 0.1",
        "# TYPE hicache_l3_prefetch_pages_loaded counter",
        "hicache_l3_prefetch_pages_loaded_total 50.0",
        "# TYPE hicache_l3_prefetch_seconds counter",
        "hicache_l3_prefetch_seconds_total 0.02",
        '# TYPE hicache_cached_tokens counter',
        'hicache_cached_tokens_total{source="device"} 5.0',
    ]) + "\n"
    figures = worker_figures({"page_size": PAGE}, text)
    assert figures.prefill_tokens_per_s == pytest.approx(16000)
    assert figures.l3_read_s_per_page == pytest.approx(0.0004)
    assert figures.host_load_s_per_page is None
    # No L2->L1 time: the default host cost, added to the L3 read.
    costs = tier_costs_from(figures)
    assert costs.host == TierCosts().host
    assert costs.external == pytest.approx(0.4 + TierCosts().host)


def test_server_info_counters_win_over_metrics() -> None:
    text = ("# TYPE hicache_prefill_step_tokens counter\nhicache_prefill_step_tokens_total 1600\n"
            "# TYPE hicache_prefill_step_seconds counter\nhicache_prefill_step_seconds_total 1.6\n")
    figures = worker_figures(info(**PREFILL), text)
    assert figures.prefill_tokens_per_s == pytest.approx(16000)


@pytest.mark.parametrize("server_info, metrics", [
    ({}, None),  # nothing reported
    (info(), "not prometheus {{{"),  # no counters, unreadable metrics
    (info(**PREFILL, storage_prefetch_pages_loaded=50), None),  # pages without seconds
    ({"internal_states": [PREFILL]}, None),  # no page size: no cost of recomputing a page
    ({**info(**PREFILL), "page_size": True}, None),
    (info(engine_num_prefill_step_tokens=16, engine_prefill_step_seconds=0.001), None),  # 1 page
])
def test_missing_or_thin_figures_fall_back_to_the_defaults(
    server_info: dict[str, Any], metrics: str | None,
) -> None:
    assert measured_tier_costs(server_info, metrics) == TierCosts()


def test_too_few_pages_leave_a_tier_at_its_default() -> None:
    figures = worker_figures(info(
        **PREFILL, storage_prefetch_pages_loaded=MIN_PAGES - 1, storage_prefetch_seconds=0.01,
        cache_num_loaded_pages=MIN_PAGES, cache_load_seconds=float("nan"),
    ), None)
    assert figures.prefill_tokens_per_s == pytest.approx(16000)
    assert figures.l3_read_s_per_page is None and figures.host_load_s_per_page is None


def test_a_tier_slower_than_recomputing_is_worth_nothing() -> None:
    costs = tier_costs_from(WorkerFigures(
        page_size=PAGE, prefill_tokens_per_s=16000, l3_read_s_per_page=0.005,
        host_load_s_per_page=0.0,
    ))
    assert costs == TierCosts(host=0.0, external=1.0)


# The live estimates: 1/16,000 s a token at the reference context (1 ms a page of 16);
# a 64-page host load of 0.64 ms latency + 0.09 ms a page (0.1 ms a page in all); an
# L3 read of 64 pages in 19.2 ms (0.3 ms a page).
ESTIMATES = {
    f"cost_prefill_seconds_per_token_context_{REFERENCE_CONTEXT}": 1 / 16000,
    "cost_l2_load_latency_seconds": 0.00064, "cost_l2_load_seconds_per_page": 0.00009,
    "cost_l3_read_reference_seconds_backend_file": 0.0192,
}
# Totals that disagree with each figure: 8,000 tokens/s, 0.5 ms a host page, 2 ms an L3 page.
TOTALS = {
    "engine_num_prefill_step_tokens": 1600, "engine_prefill_step_seconds": 0.2,
    "cache_num_loaded_pages": 100, "cache_load_seconds": 0.05,
    "storage_prefetch_pages_loaded": 50, "storage_prefetch_seconds": 0.1,
}


def test_the_reference_points_are_ones_the_engine_reports() -> None:
    assert REFERENCE_CONTEXT in REFERENCE_CONTEXTS
    assert REFERENCE_PAGES == ENGINE_REFERENCE_PAGES


def test_costs_from_the_live_estimates_alone() -> None:
    figures = worker_figures(info(**ESTIMATES), None)
    assert figures.prefill_tokens_per_s == pytest.approx(16000)
    assert figures.host_load_s_per_page == pytest.approx(0.0001)
    assert figures.l3_read_s_per_page == pytest.approx(0.0003)
    costs = tier_costs_from(figures)
    assert costs.host == pytest.approx(0.1)
    assert costs.external == pytest.approx(0.3 + 0.1)


def test_the_live_estimates_win_over_the_totals() -> None:
    assert worker_figures(info(**TOTALS, **ESTIMATES), None) == worker_figures(
        info(**ESTIMATES), None)
    totals = measured_tier_costs(info(**TOTALS), None)
    assert totals.host == pytest.approx(0.5 / 2) and totals.external == pytest.approx(1.0)


@pytest.mark.parametrize("unknown, expected", [
    # No prefill estimate: the totals' 8,000 tokens/s; the host and L3 estimates stay.
    (f"cost_prefill_seconds_per_token_context_{REFERENCE_CONTEXT}",
     WorkerFigures(PAGE, 8000, 0.0003, 0.0001)),
    # No host load estimate (its per-page coefficient unknown): the totals' 0.5 ms a page.
    ("cost_l2_load_seconds_per_page", WorkerFigures(PAGE, 16000, 0.0003, 0.0005)),
    # No L3 estimate: the totals' 2 ms a page.
    ("cost_l3_read_reference_seconds_backend_file", WorkerFigures(PAGE, 16000, 0.002, 0.0001)),
])
def test_an_unknown_estimate_falls_back_to_its_totals(
    unknown: str, expected: WorkerFigures,
) -> None:
    estimates = {k: v for k, v in ESTIMATES.items() if k != unknown}
    figures = worker_figures(info(**TOTALS, **estimates), None)
    assert figures.page_size == expected.page_size
    for name in ("prefill_tokens_per_s", "l3_read_s_per_page", "host_load_s_per_page"):
        assert getattr(figures, name) == pytest.approx(getattr(expected, name)), name


def test_an_unknown_estimate_without_totals_falls_back_to_the_default() -> None:
    estimates = {k: v for k, v in ESTIMATES.items() if not k.startswith("cost_l2")}
    costs = measured_tier_costs(info(**estimates), None)
    assert costs.host == TierCosts().host
    assert costs.external == pytest.approx(0.3 + TierCosts().host)
    assert measured_tier_costs(info(cost_prefill_samples=3, cost_l2_load_samples=0), None) \
        == TierCosts()


def test_the_slowest_l3_backend_prices_the_shared_pool() -> None:
    figures = worker_figures(info(
        **ESTIMATES, cost_l3_read_reference_seconds_backend_redis=0.064,
    ), None)
    assert figures.l3_read_s_per_page == pytest.approx(0.001)


def test_the_live_estimates_read_from_prometheus_text() -> None:
    text = "\n".join([
        "# TYPE hicache_cost_prefill_seconds_per_token gauge",
        'hicache_cost_prefill_seconds_per_token{context="1024"} 1.0',
        f'hicache_cost_prefill_seconds_per_token{{context="{REFERENCE_CONTEXT}"}} 6.25e-05',
        "# TYPE hicache_cost_l2_load_latency_seconds gauge",
        "hicache_cost_l2_load_latency_seconds 0.00064",
        "# TYPE hicache_cost_l2_load_seconds_per_page gauge",
        "hicache_cost_l2_load_seconds_per_page 9e-05",
        "# TYPE hicache_cost_l3_read_reference_seconds gauge",
        'hicache_cost_l3_read_reference_seconds{backend="file"} 0.0192',
        # The totals, which the estimates win over.
        "# TYPE hicache_prefill_step_tokens counter",
        "hicache_prefill_step_tokens_total 1600.0",
        "# TYPE hicache_prefill_step_seconds counter",
        "hicache_prefill_step_seconds_total 0.2",
    ]) + "\n"
    assert worker_figures({"page_size": PAGE}, text) == worker_figures(info(**ESTIMATES), None)


def test_server_info_estimates_win_over_metrics_estimates() -> None:
    text = ("# TYPE hicache_cost_l2_load_latency_seconds gauge\n"
            "hicache_cost_l2_load_latency_seconds 1.0\n"
            "# TYPE hicache_cost_l2_load_seconds_per_page gauge\n"
            "hicache_cost_l2_load_seconds_per_page 1.0\n")
    figures = worker_figures(info(**ESTIMATES), text)
    assert figures.host_load_s_per_page == pytest.approx(0.0001)
    # A figure info lacks comes from the metrics' estimate, before info's totals.
    estimates = {k: v for k, v in ESTIMATES.items() if not k.startswith("cost_l2")}
    figures = worker_figures(info(**TOTALS, **estimates), text)
    assert figures.host_load_s_per_page == pytest.approx((1.0 + 64) / 64)
