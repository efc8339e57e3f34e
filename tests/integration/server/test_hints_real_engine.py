"""Hints through a real server and a real engine (tiny model, L2 on, no L3): the HTTP
layer's outcomes are the hint book's, a request's own hints answer in its response, and
/metrics follows the pins. The HTTP validation itself is tested with a fake engine in
test_hints_api.py; the hints' effect on eviction in tests/integration/engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(["--enable-hierarchical-cache", "--page-size", str(PAGE)]) as running:
        yield running


def prompt(seed: int, pages: int = 6) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(pages * PAGE + 3)]


def generate(server: RunningServer, ids: list[int], **extra: Any) -> Any:
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **extra,
    })
    assert response.status_code == 200, response.text
    return response.json()


def hints(server: RunningServer, *items: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(f"{server.url}/hicache/hints", timeout=TIMEOUT,
                          json={"hints": list(items)})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    assert [r["index"] for r in results] == list(range(len(items)))
    return results


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_pin_then_unpin_a_served_prompt(server: RunningServer) -> None:
    ids = prompt(1)
    generate(server, ids)
    assert server.wait_idle()
    before = metric(server, "hicache_pinned_pages")
    [pin] = hints(server, {"kind": "pin", "input_ids": ids, "ttl_s": 60, "tenant": "t1"})
    assert pin["outcome"] == "accepted", pin
    assert pin["tokens"] == 6 * PAGE  # the whole pages of the prompt
    assert metric(server, "hicache_pinned_pages") == before + 6
    [unpin] = hints(server, {"kind": "unpin", "input_ids": ids, "tenant": "t1"})
    assert unpin["outcome"] == "accepted", unpin
    assert metric(server, "hicache_pinned_pages") == before
    [again] = hints(server, {"kind": "unpin", "input_ids": ids, "tenant": "t1"})
    assert again["outcome"] == "rejected" and "not pinned" in again["reason"]


def test_unknown_prefix_and_bad_ttl_are_rejected_per_item(server: RunningServer) -> None:
    never_served = prompt(2)
    results = hints(
        server,
        {"kind": "retain", "input_ids": never_served},
        {"kind": "pin", "input_ids": never_served},
        {"kind": "prefetch", "input_ids": never_served},
    )
    assert [r["outcome"] for r in results] == ["rejected"] * 3, results
    assert "unknown prefix" in results[0]["reason"]
    # A malformed item is a 400 and applies nothing: the valid item before it is not applied.
    ids = prompt(3)
    generate(server, ids)
    pinned = metric(server, "hicache_pinned_pages")
    response = httpx.post(f"{server.url}/hicache/hints", timeout=TIMEOUT, json={"hints": [
        {"kind": "pin", "input_ids": ids}, {"kind": "pin", "input_ids": ids, "ttl_s": -1},
    ]})
    assert response.status_code == 400 and "hints[1]" in response.text
    assert metric(server, "hicache_pinned_pages") == pinned


def test_a_requests_own_hints_answer_in_its_response(server: RunningServer) -> None:
    ids = prompt(4)
    cold = generate(server, ids)
    out = generate(server, ids, hicache_hints=[{"kind": "retain", "ttl_s": 30}])
    assert out["output_ids"] == cold["output_ids"]
    [outcome] = out["meta_info"]["hints"]
    assert outcome["kind"] == "retain" and outcome["outcome"] == "accepted", outcome
    assert outcome["tokens"] >= 6 * PAGE
    assert metric(server, "hicache_retained_pages") >= 6
    completion = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT, json={
        "prompt": ids, "max_tokens": 2, "temperature": 0,
        "hicache_hints": [{"kind": "demote"}],
    })
    assert completion.status_code == 200, completion.text
    [demoted] = completion.json()["hicache_hints"]
    assert demoted["kind"] == "demote" and demoted["outcome"] in {"accepted", "clipped"}
    assert 'hicache_hints_total{kind="retain",outcome="accepted"}' in httpx.get(
        f"{server.url}/metrics", timeout=TIMEOUT).text
