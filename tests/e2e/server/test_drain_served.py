"""SIGTERM drains a real ``hicache serve`` into its file L3, and a new server reuses it.

The first server writes back (its pages stay in L1 until evicted, so L3 lacks them all)
to a file store whose writes hang while a gate file exists (tests/gated_file_backend.py,
through the ``dynamic`` backend): the drain is held in its writing phase as long as the
test needs to see it. Prompts are served, SIGTERM comes: during the drain /health is 503
draining and new requests 503 with Retry-After: 0; once the gate opens the pages land and
the process exits 0. A new server on the same store then answers every prompt from L3
(cached storage tokens) with exactly the cold answer's greedy tokens.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from hicache.testing.server_process import ServerProcess
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
FLAGS = ["--model-preset", "tiny", "--device", "cpu", "--max-total-tokens", "1024",
         "--page-size", "16", "--hicache-storage-prefetch-policy", "wait_complete"]
STORE = {"prefetch_threshold": 16, "io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
PROMPTS = [[(7 * i + 3 + 11 * n) % 256 for i in range(200)] for n in range(3)]  # 12 pages each
PAGES = 3 * (200 // 16)
EXIT_S = 60.0


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


def test_sigterm_drains_to_l3_and_a_new_server_serves_the_cold_answer(tmp_path: Path) -> None:
    l3, gate = tmp_path / "l3", tmp_path / "write-gate"
    gated = {"module_path": "tests.gated_file_backend", "class_name": "GatedFileBackend",
             "path": str(l3), "gate": str(tmp_path / "no-read-gate"), "write_gate": str(gate),
             **STORE}
    first_flags = [*FLAGS, "--hicache-write-policy", "write_back",
                   "--hicache-storage-backend", "dynamic",
                   "--hicache-storage-backend-extra-config", json.dumps(gated)]
    # The child imports the gated backend from the repository's tests package.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    first = ServerProcess(first_flags, tmp_path / "first.log", env=env, startup_timeout_s=180.0)
    with first, httpx.Client(base_url=first.url, timeout=60.0) as client:
        cold = [generate(client, prompt)["output_ids"] for prompt in PROMPTS]
        assert metric(client, "hicache_l3_backup_pages_stored_total") == 0  # all in L1
        gate.touch()  # the drain's writes hang until the test opens the gate
        process = first.process
        assert process is not None

        process.send_signal(signal.SIGTERM)  # the server alone, as an orchestrator does

        assert wait_until(lambda: client.get("/health").status_code == 503), "no drain"
        assert client.get("/health").json() == {"status": "draining"}
        assert client.get("/get_server_info").json()["draining"] is True
        refused = client.post("/generate", json={"input_ids": PROMPTS[0]})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "0"
        assert "draining" in refused.json()["error"]["message"]
        assert wait_until(lambda: metric(client, "hicache_drain_state") == 2), "not writing"
        assert metric(client, "hicache_drain_pages_to_write") >= PAGES
        assert process.poll() is None  # held by the gate: still draining

        gate.unlink()
        code = process.wait(timeout=EXIT_S)
        log = first.log_text()
        assert code == 0, log
        assert "drain started (SIGTERM)" in log and "drain done" in log

    second_flags = [*FLAGS, "--hicache-storage-backend", "file",
                    "--hicache-storage-backend-extra-config",
                    json.dumps({"path": str(l3), **STORE})]
    with ServerProcess(second_flags, tmp_path / "second.log", startup_timeout_s=180.0) as second, \
            httpx.Client(base_url=second.url, timeout=60.0) as client:
        for prompt, tokens in zip(PROMPTS, cold, strict=True):
            warm = generate(client, prompt)
            assert warm["meta_info"]["cached_tokens_details"]["storage"] > 0
            assert warm["output_ids"] == tokens


def test_a_second_sigterm_ends_the_drain_at_once_leaving_only_whole_pages(
    tmp_path: Path,
) -> None:
    l3, gate = tmp_path / "l3", tmp_path / "write-gate"
    # A short call deadline: the write the gate holds is given up soon after the exit.
    gated = {"module_path": "tests.gated_file_backend", "class_name": "GatedFileBackend",
             "path": str(l3), "gate": str(tmp_path / "no-read-gate"), "write_gate": str(gate),
             **STORE, "io_timeout_s": 1.0}
    flags = [*FLAGS, "--hicache-write-policy", "write_back", "--drain-timeout-s", "600",
             "--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config", json.dumps(gated)]
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    server = ServerProcess(flags, tmp_path / "serve.log", env={**os.environ, "PYTHONPATH": path},
                           startup_timeout_s=180.0)
    try:
        with server, httpx.Client(base_url=server.url, timeout=60.0) as client:
            for prompt in PROMPTS:
                generate(client, prompt)
            gate.touch()
            process = server.process
            assert process is not None
            process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: metric(client, "hicache_drain_state") == 2), "not writing"

            process.send_signal(signal.SIGTERM)  # the deadline (600 s) is far away

            code = process.wait(timeout=EXIT_S)
            assert code == 0, server.log_text()
            assert "SIGTERM while draining: stopping at once" in server.log_text()
    finally:
        gate.unlink(missing_ok=True)
    # What the store shows is whole pages only (the held write never made one visible).
    check = [*FLAGS, "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", json.dumps({"path": str(l3), **STORE})]
    with ServerProcess(check, tmp_path / "check.log", startup_timeout_s=180.0) as second, \
            httpx.Client(base_url=second.url, timeout=60.0) as client:
        for prompt in PROMPTS:  # served (from L3 or computed), nothing half-written read
            assert generate(client, prompt)["meta_info"]["cached_tokens_details"]["storage"] == 0
