"""SIGTERM (or POST /hicache/drain) drains a tensor-parallel ``hicache serve``
(``--tp-size 2``, CPU, gloo) into its file L3, every rank its own shard, and a new
tensor-parallel server reuses it.

The first server writes back (its pages stay in L1, so L3 lacks them all until the
drain). Prompts are served, SIGTERM (or the admin route) comes: the drain runs as replicated cache
operations on both ranks, each writing its KV shard (its page keys name its rank), and
the process exits 0. Checked: each rank's shard of every whole page is a file in the
store; a new ``--tp-size 2`` server on the same store answers every prompt from L3
(cached storage tokens) with exactly the cold answer's greedy tokens.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.testing.server_process import ServerProcess

FLAGS = ["--model-preset", "tiny", "--device", "cpu", "--max-total-tokens", "1024",
         "--page-size", "16", "--tp-size", "2",
         "--hicache-storage-prefetch-policy", "wait_complete",
         # A tiny prompt may be cheaper to recompute than to load: the test asserts L3 hits.
         "--hicache-reuse-policy", "load"]
STORE = {"prefetch_threshold": 16, "io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
PROMPTS = [[(7 * i + 3 + 11 * n) % 256 for i in range(200)] for n in range(3)]  # 12 pages each
PAGES = 3 * (200 // 16)
TP_SIZE = 2
EXIT_S = 120.0
START_S = 300.0
KEY = "drain-key"


def generate(client: httpx.Client, prompt: list[int]) -> dict[str, Any]:
    body = {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def page_files(l3: Path) -> list[Path]:
    return [p for p in l3.glob("??/*") if not p.name.startswith(".")]


@pytest.mark.parametrize("trigger", ["SIGTERM", "POST /hicache/drain"])
def test_a_drain_writes_every_ranks_shard_to_l3_and_a_new_tp_server_serves_the_cold_answer(
    tmp_path: Path, trigger: str,
) -> None:
    l3 = tmp_path / "l3"
    store = ["--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", json.dumps({"path": str(l3), **STORE})]
    first = ServerProcess([*FLAGS, "--hicache-write-policy", "write_back",
                           "--admin-api-key", KEY, *store],
                          tmp_path / "first.log", startup_timeout_s=START_S)
    with first, httpx.Client(base_url=first.url, timeout=120.0) as client:
        cold = [generate(client, prompt)["output_ids"] for prompt in PROMPTS]
        assert metric(client, "hicache_l3_backup_pages_stored_total") == 0  # all in L1
        assert page_files(l3) == []
        process = first.process
        assert process is not None

        if trigger == "SIGTERM":
            process.send_signal(signal.SIGTERM)  # the server alone, as an orchestrator does
        else:
            started = client.post("/hicache/drain", headers={"authorization": f"Bearer {KEY}"})
            assert started.status_code == 202, started.text

        code = process.wait(timeout=EXIT_S)
        log = first.log_text()
        assert code == 0, log
        assert f"drain started ({trigger})" in log and "drain done" in log, log
    # Every whole page of every prompt, once per rank: each rank stored its own shard.
    assert len(page_files(l3)) == TP_SIZE * PAGES, first.log_text()

    with ServerProcess([*FLAGS, *store], tmp_path / "second.log",
                       startup_timeout_s=START_S) as second, \
            httpx.Client(base_url=second.url, timeout=120.0) as client:
        for prompt, tokens in zip(PROMPTS, cold, strict=True):
            warm = generate(client, prompt)
            assert warm["meta_info"]["cached_tokens_details"]["storage"] == 200 // 16 * 16, \
                warm["meta_info"]
            assert warm["output_ids"] == tokens
