"""The load-or-recompute choice through a real server: a /generate whose prompt the host
tier (L2) held answers with ``meta_info.reuse`` (the decision, the tokens loaded and
computed again, the predicted and actual times), a cold one has no ``reuse`` key, and
/metrics counts the decisions and, once one was priced, the prediction's error.

The server has no route that empties L1 alone (``/flush_cache`` empties L2 too): the
test reaches the in-process engine for it, as benchmarks do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.engine.reuse_plan import Decision
from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(30.0)
PROMPT = 9 * PAGE + 5  # nine whole pages, the last token computed anyway
HIT = 9 * PAGE
REPORT_KEYS = {
    "decision", "cached_tokens", "loaded_tokens", "recomputed_tokens", "predicted_s",
    "predicted_load_s", "predicted_recompute_s", "predicted_wait_s", "waited_s", "actual_s",
}
DECISIONS = {d.value for d in Decision}


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with serve_in_thread(["--enable-hierarchical-cache"]) as running:
        yield running


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(length)]


def generate(server: RunningServer, ids: list[int]) -> Any:
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    })
    assert response.status_code == 200, response.text
    return response.json()


def evict_device(server: RunningServer) -> None:
    """Leave every cached prompt in L2 alone (its host copy stays)."""
    assert server.wait_idle()
    assert server.engine.evict_device_cache() > 0


def from_l2(server: RunningServer, ids: list[int]) -> Any:
    """``ids`` cold, then again from L2; returns the second answer (the same tokens)."""
    cold = generate(server, ids)
    assert "reuse" not in cold["meta_info"]  # nothing cached: nothing to choose
    evict_device(server)
    warm = generate(server, ids)
    assert warm["output_ids"] == cold["output_ids"]
    return warm


def scrape(server: RunningServer) -> dict[str, float]:
    response = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines() if line and not line.startswith("#")
    }


def decisions(metrics: dict[str, float]) -> dict[str, float]:
    prefix = 'hicache_reuse_decisions_total{decision="'
    return {key[len(prefix):-2]: value for key, value in metrics.items()
            if key.startswith(prefix)}


def assert_report(meta: dict[str, Any]) -> dict[str, Any]:
    report = meta["reuse"]
    assert set(report) == REPORT_KEYS, report
    assert report["decision"] in DECISIONS
    assert report["cached_tokens"] + report["recomputed_tokens"] == HIT, report
    assert report["loaded_tokens"] == meta["cached_tokens_details"]["host"]
    assert report["actual_s"] is not None and report["actual_s"] > 0
    assert report["waited_s"] is None  # no L3: nothing was waited for
    return dict(report)


def test_a_host_hit_reports_its_choice_and_a_cold_prompt_none(server: RunningServer) -> None:
    # The first hit: the cost model knows nothing yet, so the hit is loaded unpriced.
    first = from_l2(server, prompt(0))
    meta = first["meta_info"]
    assert meta["cached_tokens_details"] == {"device": 0, "host": HIT, "storage": 0}
    report = assert_report(meta)
    assert report["decision"] == Decision.UNPRICED.value
    assert report["loaded_tokens"] == report["cached_tokens"] == HIT
    assert report["predicted_s"] is None
    counts = decisions(scrape(server))
    assert counts == {Decision.UNPRICED.value: 1.0}
    assert not any(k.startswith("hicache_reuse_prediction_ratio_count") for k in scrape(server))

    # Cold prompts teach it the prefill (eight steps), host hits the host->device loads.
    for seed in range(1, 11):
        assert "reuse" not in generate(server, prompt(seed, 40 + 12 * seed))["meta_info"]
    for seed in range(11, 14):
        from_l2(server, prompt(seed))
    priced = from_l2(server, prompt(20))
    report = assert_report(priced["meta_info"])
    assert report["decision"] != Decision.UNPRICED.value
    assert report["predicted_s"] is not None and report["predicted_s"] > 0
    assert report["predicted_load_s"] is not None and report["predicted_recompute_s"] is not None

    metrics = scrape(server)
    counts = decisions(metrics)
    assert sum(counts.values()) == 1 + 3 + 1  # one per hit, none per cold prompt
    assert counts[report["decision"]] >= 1
    label = f'decision="{report["decision"]}"'
    assert metrics[f"hicache_reuse_prediction_ratio_count{{{label}}}"] >= 1
    buckets = [k for k in metrics if k.startswith("hicache_reuse_prediction_ratio_bucket{")
               and label in k]
    assert buckets and metrics[f'hicache_reuse_prediction_ratio_bucket{{{label},le="+Inf"}}'] \
        == metrics[f"hicache_reuse_prediction_ratio_count{{{label}}}"]
    # The unpriced hit has no prediction to compare with.
    assert not any('decision="unpriced"' in k for k in metrics
                   if k.startswith("hicache_reuse_prediction_ratio"))


def test_a_streamed_host_hit_reports_on_its_last_chunk(server: RunningServer) -> None:
    ids = prompt(30)
    generate(server, ids)
    evict_device(server)
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
        "input_ids": ids, "stream": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    })
    assert response.status_code == 200
    chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) >= 2
    assert all("reuse" not in c["meta_info"] for c in chunks[:-1])
    assert_report(chunks[-1]["meta_info"])
