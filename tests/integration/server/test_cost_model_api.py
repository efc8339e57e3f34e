"""The live cost model through a real server: /get_server_info has its ``cost_model``
block (coefficients, sample counts, predictions at reference points) and /metrics its
``hicache_cost_*`` gauges, labelled by prompt length and by L3 backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(30.0)
PROMPTS = [[(seed * 7 + i) % 250 + 1 for i in range(120)] for seed in range(12)]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    extra = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    args = [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", extra,
    ]
    with serve_in_thread(args) as running:
        yield running


def generate(server: RunningServer, ids: list[int]) -> None:
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    })
    assert response.status_code == 200, response.text


def cost_model(server: RunningServer) -> Any:
    response = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT)
    assert response.status_code == 200
    return response.json()["cost_model"]


def scrape(server: RunningServer) -> dict[str, float]:
    response = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines() if line and not line.startswith("#")
    }


def test_cost_model_is_unknown_then_exported_once_learned(server: RunningServer) -> None:
    fresh = cost_model(server)
    assert fresh["prefill"]["samples"] == 0 and fresh["prefill"]["coefficients"] is None
    assert fresh["prefill"]["cold_prefill_seconds"] == {"1024": None, "4096": None,
                                                        "16384": None}
    assert fresh["l3"]["file"]["samples"] == 0
    assert fresh["l3"]["file"]["latency_seconds"] is None
    assert not any(key.startswith("hicache_cost_prefill_seconds_per_token")
                   for key in scrape(server))

    for ids in PROMPTS:
        generate(server, ids)
    assert server.wait_until(
        lambda: server.engine.metrics()["storage_backup_pages_stored"] >= 12 * 7)
    assert server.wait_idle()
    assert httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT).status_code == 200
    for ids in PROMPTS[:4]:
        generate(server, ids)  # from L3: read into host memory, then loaded to the device

    block = cost_model(server)
    prefill = block["prefill"]
    assert prefill["samples"] >= 8
    assert prefill["coefficients"]["step_seconds"] >= 0
    assert all(seconds > 0 for seconds in prefill["cold_prefill_seconds"].values())
    assert block["l2_load"]["samples"] >= 3 and block["l2_load"]["reference_load_seconds"] > 0
    l3 = block["l3"]["file"]
    assert l3["samples"] >= 3 and l3["reference_read_seconds"] > 0
    assert block["reference_pages"] == 64

    metrics = scrape(server)
    for tokens in (1024, 4096, 16384):
        assert metrics[f'hicache_cost_prefill_seconds_per_token{{context="{tokens}"}}'] > 0
    assert metrics["hicache_cost_l2_load_seconds_per_page"] >= 0
    assert metrics['hicache_cost_l3_read_latency_seconds{backend="file"}'] >= 0
    assert metrics['hicache_cost_l3_read_samples{backend="file"}'] >= 3
    assert metrics["hicache_cost_prefill_samples"] >= 8
