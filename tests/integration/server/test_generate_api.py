"""/generate over every tier (device, host, file L3 in a temporary directory), cache flushes,
concurrent streams, client disconnects, /metrics and /health."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, long_stream, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def server(l3_dir: Path) -> Iterator[RunningServer]:
    extra = json.dumps({"path": str(l3_dir), "prefetch_threshold": PAGE})
    args = [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", extra,
    ]
    with serve_in_thread(args) as running:
        yield running


def generate(server: RunningServer, payload: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/generate", json=payload, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON of each ``data:`` event up to ``[DONE]`` (which must come)."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def test_generate_non_stream_and_stream_agree(server: RunningServer) -> None:
    payload = {"text": "Tell me about paged KV caches.", "sampling_params": greedy(10)}
    plain = generate(server, payload)
    assert len(plain["output_ids"]) == 10
    meta = plain["meta_info"]
    assert meta["completion_tokens"] == 10
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["prompt_tokens"] == len(server.engine.tokenize(payload["text"]))
    assert meta["e2e_latency"] > 0 and meta["ttft"] is not None

    with httpx.stream("POST", f"{server.url}/generate", json={**payload, "stream": True},
                      timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(sse_payloads(response.iter_lines()))
    # Each chunk carries everything so far; only the last one has a finish reason.
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # The time to the first token is there from the first chunk with a token on.
    assert all(c["meta_info"]["ttft"] is not None for c in chunks if c["output_ids"])
    assert len({c["meta_info"]["ttft"] for c in chunks}) == 1
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["text"] == plain["text"]


def test_repeat_hits_device_then_storage_after_flush(
    server: RunningServer, l3_dir: Path
) -> None:
    engine = server.engine
    prompt = list(range(1, 1 + 6 * PAGE + 5))  # six whole pages and a partial one
    payload = {"input_ids": prompt, "sampling_params": greedy(12)}
    cold = generate(server, payload)
    assert cold["meta_info"]["cached_tokens"] == 0

    warm = generate(server, payload)
    details = warm["meta_info"]["cached_tokens_details"]
    assert details == {"device": 6 * PAGE, "host": 0, "storage": 0}
    assert warm["meta_info"]["cached_tokens"] == 6 * PAGE
    assert warm["output_ids"] == cold["output_ids"]

    # Write-through copies the pages to the host, then to L3; wait for the L3 copies.
    def stored() -> bool:
        status = engine.storage_status()
        return bool(status["metrics"]["backup_pages_stored"] >= 6)

    assert server.wait_until(stored)
    assert any(p.is_file() for p in l3_dir.rglob("*.*m")), "no page file in the L3 directory"

    flushed = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT)
    assert flushed.status_code == 200 and flushed.json()["flushed"] is True
    assert engine.metrics()["device_pool_used_pages"] == 0

    from_l3 = generate(server, payload)
    details = from_l3["meta_info"]["cached_tokens_details"]
    assert details["storage"] == 6 * PAGE and details["device"] == 0
    # KV read back from disk gives the very same greedy continuation.
    assert from_l3["output_ids"] == cold["output_ids"]
    assert from_l3["text"] == cold["text"]


async def _stream_lengths(url: str, clients: int, max_new_tokens: int) -> list[list[int]]:
    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        payload = {"text": f"client {i} asks for its own story", "stream": True,
                   "sampling_params": greedy(max_new_tokens, seed=i)}
        seen: list[int] = []
        async with client.stream("POST", f"{url}/generate", json=payload) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return seen
                ids = json.loads(data)["output_ids"]
                assert ids[: len(seen)] == seen  # streamed ids only ever grow
                seen = ids
        raise AssertionError("stream ended without [DONE]")

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(clients)))


def test_32_concurrent_streams_finish_whole(server: RunningServer) -> None:
    results = asyncio.run(_stream_lengths(server.url, 32, 24))
    assert [len(ids) for ids in results] == [24] * 32
    assert server.wait_idle()
    server.engine.check_integrity()


def test_client_disconnect_aborts_and_frees(server: RunningServer) -> None:
    engine = server.engine
    aborted = engine.metrics()["engine_num_aborted"]
    with long_stream(server):
        # Busy: the cache cannot be flushed while a request holds pages.
        busy = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT)
        assert busy.status_code == 409
        assert "running" in busy.json()["error"]["message"]
        assert not engine.is_idle()
    # The client went away mid-stream: the request is aborted and frees what it held.
    assert server.wait_until(lambda: engine.metrics()["engine_num_aborted"] == aborted + 1)
    assert server.wait_idle()
    engine.check_integrity()
    assert engine.flush_cache()
    assert engine.metrics()["device_pool_used_pages"] == 0
    # And the server goes on serving.
    again = generate(server, {"text": "still there?", "sampling_params": greedy(3)})
    assert len(again["output_ids"]) == 3


def test_health_and_metrics(server: RunningServer) -> None:
    generate(server, {"text": "count me", "sampling_params": greedy(4)})
    health = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.json()["l3"] == {"attached": True, "backend": "file"}

    response = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines() if line and not line.startswith("#")
    }
    for name in (
        'hicache_cached_tokens_total{source="device"}',
        'hicache_cached_tokens_total{source="host"}',
        'hicache_cached_tokens_total{source="storage"}',
        "hicache_cache_hit_rate", "hicache_host_pool_usage", "hicache_device_pool_usage",
        "hicache_l3_prefetch_pages_loaded_total", "hicache_l3_backup_pages_stored_total",
        "hicache_l2_backup_pages_total", "hicache_prompt_tokens_total",
        "hicache_generation_tokens_total", "hicache_running_requests",
        "hicache_time_to_first_token_seconds_count", "hicache_e2e_request_latency_seconds_count",
        'hicache_e2e_request_latency_seconds_bucket{le="+Inf"}',
    ):
        assert name in samples, f"{name} missing from /metrics"
    engine = server.engine.metrics()
    assert samples["hicache_prompt_tokens_total"] == engine["engine_num_prompt_tokens"]
    assert samples["hicache_time_to_first_token_seconds_count"] >= 1
    assert 0 <= samples["hicache_cache_hit_rate"] <= 1
    assert samples["hicache_l3_attached"] == 1
    # The core set's share of the host pool (the default --hicache-core-fraction) is an
    # upper bound on what it holds, and what it holds is on the host.
    assert 0 <= samples["hicache_host_core_pages"] <= 0.75 * samples["hicache_host_pool_pages"]
    assert samples["hicache_host_core_pages"] <= samples["hicache_host_pool_used_pages"]


@pytest.mark.parametrize(
    ("route", "payload"),
    [
        ("/generate", {"text": "a long answer, please"}),
        ("/v1/completions", {"prompt": "a long answer, please"}),
    ],
)
def test_client_disconnect_aborts_a_non_streaming_request(
    server: RunningServer, route: str, payload: dict[str, Any]
) -> None:
    engine = server.engine
    aborted = engine.metrics()["engine_num_aborted"]
    length = engine.max_context_len - 64
    if route == "/generate":
        body = {**payload, "sampling_params": {"max_new_tokens": length, "ignore_eos": True}}
    else:
        body = {**payload, "max_tokens": length, "ignore_eos": True}
    # The client gives up long before the answer could be ready, and closes the connection.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{route}", json=body, timeout=httpx.Timeout(30.0, read=0.5))
    assert server.wait_until(lambda: engine.metrics()["engine_num_aborted"] == aborted + 1)
    assert server.wait_idle()
    engine.check_integrity()
