"""Measured tier costs from what a worker reports, and the fallback to the defaults."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.router.tier_costs import (
    MIN_PAGES,
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
