"""A worker's live cost model as the router reads it (the same fit its reuse plans use),
the fallbacks figure by figure, and the TTFT metrics and decision log it feeds."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.reuse_plan import CostSnapshot
from hicache.estimators import PrefillCoefficients
from hicache.router.decisions import DecisionLog
from hicache.router.live_costs import DEFAULT_SECONDS_PER_TOKEN, resolve_costs, worker_cost_snapshot
from hicache.router.metrics import RouterMetrics
from hicache.router.types import RouteDecision, TierOverlap
from hicache.router.workers import Worker, parse_server_info

FIT = {"cost_prefill_coef_step_seconds": 0.01, "cost_prefill_coef_seconds_per_token": 2e-4,
       "cost_prefill_coef_seconds_per_pair": 1e-8,
       "cost_prefill_coef_seconds_per_decode_row": 1e-3,
       "cost_l2_load_latency_seconds": 0.002, "cost_l2_load_seconds_per_page": 1e-4,
       "cost_l3_read_latency_seconds_backend_file": 0.004,
       "cost_l3_read_reference_seconds_backend_file": 0.004 + 64 * 5e-4,
       "cost_l3_read_latency_seconds_backend_redis": 0.001,
       "cost_l3_read_reference_seconds_backend_redis": 0.001 + 64 * 1e-4}


def test_the_fit_is_read_whole_from_internal_states() -> None:
    snapshot = worker_cost_snapshot(
        {"internal_states": [FIT], "chunked_prefill_size": 512, "page_size": 16}, None)
    assert snapshot.prefill == PrefillCoefficients(0.01, 2e-4, 1e-8, 1e-3)
    assert snapshot.chunk_tokens == 512
    assert (snapshot.load_latency_s, snapshot.load_seconds_per_page) == (0.002, 1e-4)
    # The slowest backend's read: the router cannot tell where a page would come from.
    assert snapshot.read_latency_s == pytest.approx(0.004)
    assert snapshot.read_seconds_per_page == pytest.approx(5e-4)


def test_the_fit_is_read_from_metrics_text_too() -> None:
    text = "\n".join([
        "hicache_cost_prefill_step_seconds 0.01", "hicache_cost_prefill_token_seconds 0.0002",
        "hicache_cost_prefill_attention_pair_seconds 0",
        "hicache_cost_prefill_decode_row_seconds 0",
        "hicache_cost_l2_load_latency_seconds 0", "hicache_cost_l2_load_seconds_per_page 0.001",
        'hicache_cost_l3_read_reference_seconds{backend="file"} 0.064', ""])
    snapshot = worker_cost_snapshot({"page_size": 16}, text)
    assert snapshot.prefill == PrefillCoefficients(0.01, 2e-4, 0.0, 0.0)
    assert snapshot.load_seconds_per_page == pytest.approx(0.001)
    assert (snapshot.read_latency_s, snapshot.read_seconds_per_page) == (0.0, 0.001)


def test_before_the_fit_the_totals_stand_in_and_nothing_is_none() -> None:
    totals = {"engine_num_prefill_step_tokens": 4000, "engine_prefill_step_seconds": 4.0,
              "cache_num_loaded_pages": 100, "cache_load_seconds": 0.1}
    snapshot = worker_cost_snapshot({"internal_states": [totals], "page_size": 4}, None)
    assert snapshot.prefill == PrefillCoefficients(0.0, 1e-3, 0.0, 0.0)
    assert (snapshot.load_latency_s, snapshot.load_seconds_per_page) == (0.0, 0.001)
    assert snapshot.read_seconds_per_page is None
    empty = worker_cost_snapshot({"page_size": 4}, None)
    assert empty == CostSnapshot(prefill=None, chunk_tokens=None)


def test_missing_figures_come_from_the_median_then_the_defaults() -> None:
    measured = worker_cost_snapshot({"internal_states": [FIT], "page_size": 16}, None)
    only_prefill = CostSnapshot(prefill=PrefillCoefficients(0.0, 1e-3, 0.0, 0.0),
                                chunk_tokens=None)
    resolved, filled = resolve_costs(only_prefill, [measured, None], page_size=16)
    assert filled == ("host_load=median", "l3_read=median")
    assert resolved.prefill == only_prefill.prefill
    assert resolved.load_seconds_per_page == measured.load_seconds_per_page
    resolved, filled = resolve_costs(None, [None], page_size=16)
    assert filled == ("prefill=default", "host_load=default", "l3_read=default")
    page_s = 16 * DEFAULT_SECONDS_PER_TOKEN
    assert resolved.load_s(1) == pytest.approx(0.1 * page_s)
    assert resolved.read_s(1) == pytest.approx(0.4 * page_s)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_metrics_carry_predicted_measured_error_and_each_workers_queue() -> None:
    worker = Worker(parse_server_info("http://127.0.0.1:1", {"page_size": 4,
                                                             "served_model_name": "m"}))

    class Source:
        def all(self) -> list[Worker]:
            return [worker]

    metrics = RouterMetrics(Source(), lambda: 0)
    decision = RouteDecision(worker=worker.url, policy="predicted_ttft", predicted_ttft_s=0.4,
                             terms={"queue_s": 0.1, "own_s": 0.3})
    metrics.observe_decision(decision, num_pages=4, latency_s=0.001)
    metrics.observe_first_token(decision, 0.5)
    worker.ledger.admit(decision.predicted_prefill_s)
    samples = _samples(metrics.render())
    policy = (("policy", "predicted_ttft"),)
    assert samples[("router_predicted_ttft_seconds_sum", policy)] == pytest.approx(0.4)
    assert samples[("router_measured_ttft_seconds_sum", policy)] == pytest.approx(0.5)
    # Measured - predicted = 0.1 s: in the 0.1 bucket, not the 0.025 one.
    error = "router_ttft_prediction_error_seconds_bucket"
    assert samples[(error, (("le", "0.025"), *policy))] == 0
    assert samples[(error, (("le", "0.1"), *policy))] == 1
    assert samples[("router_ttft_prediction_ratio_sum", policy)] == pytest.approx(1.25)
    queued = samples[("router_worker_queued_prefill_seconds", (("worker", worker.url),))]
    assert 0.0 < queued <= 0.3


def test_the_decision_log_keeps_the_newest_and_is_bounded() -> None:
    log = DecisionLog(capacity=3)
    for i in range(5):
        entry = log.record(RouteDecision(worker=f"http://u:p@w{i}:1", policy="p"), stream=True)
    entry["measured_ttft_s"] = 0.2
    last = log.last(10)
    assert [e["id"] for e in last] == [3, 4, 5]
    assert last[-1]["measured_ttft_s"] == 0.2
    assert "u:p" not in last[-1]["worker"]  # no credentials in the debug view
    assert [e["id"] for e in log.last(1)] == [5]
    assert log.last(0) == []


def test_a_logged_decision_shows_every_workers_score_and_cached_prefix() -> None:
    decision = RouteDecision(
        worker="http://w0:1", policy="tier_aware",
        logits={"http://u:p@w0:1": 3.5, "http://w1:1": 7.0},
        overlaps={"http://u:p@w0:1": TierOverlap(gpu=1, host=4, external=6),
                  "http://w1:1": TierOverlap()},
    )
    entry = DecisionLog().record(decision, stream=True)
    assert entry["logits"] == {"http://***@w0:1": 3.5, "http://w1:1": 7.0}  # no credentials
    assert entry["overlaps"] == {"http://***@w0:1": [1, 4, 6], "http://w1:1": [0, 0, 0]}
