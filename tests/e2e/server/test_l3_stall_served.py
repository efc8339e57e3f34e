"""A stuck L3 read behind a real ``hicache serve``: seen, bounded, and forgotten when it unsticks.

The served L3 is a file store whose reads hang while a gate file exists
(tests/gated_file_backend.py, through the ``dynamic`` backend). A prompt goes
to L3, the local tiers are flushed, and the gate is closed: the same prompt
must still be answered (recomputed, equal to the cold answer) within the L3
call deadline plus a margin, the stall must show in /metrics and in the log,
and once the gate opens the hung read returns, its host pages come back and the
prompt is served from L3 again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache.testing.server_process import ServerProcess
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
IO_TIMEOUT_S = 2.0
# Scheduling and a machine busy with other work, on top of the deadline. The gated read
# returns only when the test removes the gate, so a request that waited on it would not
# answer before the client gives up (REQUEST_TIMEOUT_S): the margin can be generous.
MARGIN_S = 30.0
REQUEST_TIMEOUT_S = 120.0
PROMPT = [(7 * i + 3) % 256 for i in range(200)]  # 12 whole pages of 16 tokens


def generate(client: httpx.Client) -> dict[str, Any]:
    body = {"input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    response = client.post("/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    assert wait_until(condition, timeout_s, poll_s=0.1), f"timed out waiting for {what}"


TIMEOUTS = ("hicache_l3_failures_total", (("reason", "timeout"), ("source", "controller")))
STALLED = ("hicache_l3_stalled_calls", ())
BACKED_UP = ("hicache_l3_backup_pages_stored_total", ())


def test_a_stuck_l3_read_is_reported_bounded_and_recovered(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    extra = {
        "module_path": "tests.gated_file_backend", "class_name": "GatedFileBackend",
        "path": str(tmp_path / "l3"), "gate": str(gate), "io_timeout_s": IO_TIMEOUT_S,
        "prefetch_threshold": 16, "breaker_backoff_base": 0.2, "breaker_backoff_max": 0.5,
        # Only the call deadline ends the wait for the hung read, not the prefetch's own.
        "prefetch_timeout_max": 2 * REQUEST_TIMEOUT_S,
    }
    flags = [
        "--model-preset", "tiny", "--device", "cpu", "--max-total-tokens", "1024",
        "--page-size", "16", "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
    ]
    # The child imports the gated backend from the repository's tests package.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    with ServerProcess(flags, tmp_path / "serve.log", env=env, startup_timeout_s=180.0) as server, \
            httpx.Client(base_url=server.url, timeout=60.0) as client:
        cold = generate(client)
        until(lambda: scrape(client).get(BACKED_UP, 0.0) >= len(PROMPT) // 16, "the L3 backup")

        gate.touch()  # from now on every L3 read hangs
        assert client.post("/flush_cache").status_code == 200
        began = time.monotonic()
        stuck = generate(client)
        elapsed = time.monotonic() - began
        assert elapsed < IO_TIMEOUT_S + MARGIN_S, elapsed
        assert stuck["output_ids"] == cold["output_ids"]
        assert stuck["meta_info"]["cached_tokens_details"]["storage"] == 0
        metrics = scrape(client)
        assert metrics.get(TIMEOUTS) == 1.0, sorted(k for k in metrics if "l3" in k[0])
        assert metrics.get(STALLED) == 1.0
        assert "get stalled" in server.log_text()
        assert client.get("/health", timeout=MARGIN_S).status_code == 200

        gate.unlink()  # the store answers again: the hung read returns
        until(lambda: scrape(client).get(STALLED) == 0.0, "the hung read to return")
        assert "answered again" in server.log_text()

        # After the breaker's backoff the next request's lookup is its trial call.
        def served_from_l3() -> bool:
            assert client.post("/flush_cache").status_code == 200
            answer = generate(client)
            assert answer["output_ids"] == cold["output_ids"]
            return bool(answer["meta_info"]["cached_tokens_details"]["storage"] > 0)

        until(served_from_l3, "L3 to serve the prompt again")
