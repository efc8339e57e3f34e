"""The default policy's tier costs, measured: the router reads them from what the workers
report (fake workers on loopback, and a real server that has served prompts from every
tier), the live cost model's estimates first, the totals where an estimate is unknown,
and follows them as they change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.router.live_costs import worker_cost_snapshot
from hicache.router.tier_costs import REFERENCE_CONTEXT, REFERENCE_PAGES
from hicache.router.types import TierCosts
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import running_router
from tests.server_fixtures import serve_in_thread
from tests.waiting import wait_until

# At page 4 (the fake worker's). Totals: 1000 prompt tokens/s and 1 ms per host page:
# recomputing a page takes 4 ms, loading it 1 ms, so a host page costs a quarter.
TOTALS = {"engine_num_prefill_step_tokens": 4000, "engine_prefill_step_seconds": 4.0,
          "cache_num_loaded_pages": 100, "cache_load_seconds": 0.1,
          "storage_prefetch_pages_loaded": 100, "storage_prefetch_seconds": 0.2}
# Estimates: 0.5 ms a token at the reference context (2 ms a page), a 64-page host load
# in 32 ms (0.5 ms a page), an L3 read of 64 pages in 64 ms (1 ms a page).
ESTIMATES = {f"cost_prefill_seconds_per_token_context_{REFERENCE_CONTEXT}": 0.0005,
             "cost_l2_load_latency_seconds": 0.0, "cost_l2_load_seconds_per_page": 0.0005,
             "cost_l3_read_reference_seconds_backend_file": 0.064}


def test_measured_tier_costs_follow_what_the_workers_report() -> None:
    counters = {k: v for k, v in TOTALS.items() if k.startswith(("engine", "cache"))}
    worker = FakeWorker(extra_info={"internal_states": [counters]})
    costs: dict[str, TierCosts] = {}
    with fake_workers(worker) as (url,), running_router([url], tier_costs=costs):
        assert wait_until(lambda: url in costs)
        assert costs[url].host == pytest.approx(0.25)
        counters["cache_load_seconds"] = 0.2  # slower loads: the next probes see it
        assert wait_until(lambda: costs[url].host == pytest.approx(0.5))
        # The host load estimate, once learned, wins over the totals.
        counters.update(cost_l2_load_latency_seconds=0.0, cost_l2_load_seconds_per_page=0.001)
        assert wait_until(lambda: costs[url].host == pytest.approx(0.25))


@pytest.mark.parametrize("reported, expected", [
    # Only the live estimates: a host page costs 0.5/2, an L3 page 1/2 more.
    (ESTIMATES, TierCosts(host=0.25, external=0.75)),
    # Only the totals: 4 ms to recompute, 1 ms from host, 2 ms more from L3.
    (TOTALS, TierCosts(host=0.25, external=0.75)),
    # Both, the totals' loads and reads twice as slow (alone: host 0.5, L3 1.0): the
    # estimates win.
    ({**TOTALS, "cache_load_seconds": 0.2, "storage_prefetch_seconds": 0.4, **ESTIMATES},
     TierCosts(host=0.25, external=0.75)),
    # The L3 estimate unknown: its totals (2 ms a page, against the estimates' 2 ms
    # recompute) stand in; the rest from the estimates.
    ({**TOTALS, **{k: v for k, v in ESTIMATES.items() if "_l3_" not in k}},
     TierCosts(host=0.25, external=1.0)),
    # The prefill estimate unknown: the totals' 4 ms a page against the estimates'
    # 0.5 ms host and 1 ms L3 pages.
    ({**TOTALS, **{k: v for k, v in ESTIMATES.items() if "prefill" not in k}},
     TierCosts(host=0.125, external=0.375)),
])
def test_a_workers_estimates_come_first_then_its_totals(
    reported: dict[str, float], expected: TierCosts,
) -> None:
    worker = FakeWorker(extra_info={"internal_states": [reported]})
    costs: dict[str, TierCosts] = {}
    with fake_workers(worker) as (url,), running_router([url], tier_costs=costs):
        assert wait_until(lambda: url in costs)
        assert costs[url].host == pytest.approx(expected.host)
        assert costs[url].external == pytest.approx(expected.external)


PAGE = 16
TIMEOUT = httpx.Timeout(30.0)
PROMPTS = [[(seed * 7 + i) % 250 + 1 for i in range(120)] for seed in range(12)]


def test_a_real_workers_costs_come_from_its_cost_model(tmp_path: Path) -> None:
    extra = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    args = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", extra]
    with serve_in_thread(args) as worker:
        def generate(ids: list[int]) -> None:
            response = httpx.post(f"{worker.url}/generate", timeout=TIMEOUT, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            assert response.status_code == 200, response.text

        for ids in PROMPTS:
            generate(ids)
        assert worker.wait_until(
            lambda: worker.engine.metrics()["storage_backup_pages_stored"] >= 12 * 7)
        assert worker.wait_idle()
        flushed = httpx.post(f"{worker.url}/flush_cache", timeout=TIMEOUT)
        assert flushed.status_code == 200
        for ids in PROMPTS[:4]:
            generate(ids)  # from L3: read into host memory, then loaded to the device
        assert worker.wait_idle()
        block: Any = httpx.get(f"{worker.url}/get_server_info",
                               timeout=TIMEOUT).json()["cost_model"]
        assert block["reference_pages"] == REFERENCE_PAGES

        recompute_s = PAGE * block["prefill"]["cold_prefill_seconds"][str(REFERENCE_CONTEXT)] \
            / REFERENCE_CONTEXT
        host = block["l2_load"]["reference_load_seconds"] / REFERENCE_PAGES / recompute_s
        external = block["l3"]["file"]["reference_read_seconds"] / REFERENCE_PAGES \
            / recompute_s + host
        expected = TierCosts(host=min(1.0, host), external=min(1.0, external))

        costs: dict[str, TierCosts] = {}
        with running_router([worker.url], tier_costs=costs):
            assert wait_until(lambda: worker.url in costs)
            assert costs[worker.url].host == pytest.approx(expected.host, rel=1e-6)
            assert costs[worker.url].external == pytest.approx(expected.external, rel=1e-6)

        # predicted_ttft reads the same fit whole, from either source alike.
        info = httpx.get(f"{worker.url}/get_server_info", timeout=TIMEOUT).json()
        text = httpx.get(f"{worker.url}/metrics", timeout=TIMEOUT).text
        from_info = worker_cost_snapshot(info, None)
        from_metrics = worker_cost_snapshot({"page_size": info["page_size"]}, text)
        coefficients = block["prefill"]["coefficients"]
        for snapshot in (from_info, from_metrics):
            assert snapshot.prefill is not None
            assert snapshot.prefill.seconds_per_token == pytest.approx(
                coefficients["seconds_per_token"], rel=1e-6)
            assert snapshot.prefill.seconds_per_pair == pytest.approx(
                coefficients["seconds_per_pair"], rel=1e-6)
            assert snapshot.load_s(REFERENCE_PAGES) == pytest.approx(
                block["l2_load"]["reference_load_seconds"], rel=1e-6)
            assert snapshot.read_s(REFERENCE_PAGES) == pytest.approx(
                block["l3"]["file"]["reference_read_seconds"], rel=1e-6)
        assert from_info.chunk_tokens == info["chunked_prefill_size"]
