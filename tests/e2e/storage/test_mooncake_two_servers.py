"""Two `hicache serve` processes on one Mooncake master hit each other's pages.

Server A answers a prompt cold and its pages go to Mooncake (A's /flush_cache
waits for its backups); server B, a separate process with its own L1 and L2,
then answers the same prompt from storage with the same greedy tokens, and
the other way round.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from hicache.testing.mooncake_master import MasterProcess
from hicache.testing.server_process import ServerProcess
from tests.mooncake_fixtures import extra_fixture, master_fixture  # noqa: F401 - fixtures

PAGE = 16
PROMPT = list(range(3, 3 + 200))  # token ids; 12 whole pages before the last token
REUSED = (len(PROMPT) - 1) // PAGE * PAGE


def server_args(extra: dict[str, Any]) -> list[str]:
    config = {**extra, "prefetch_threshold": PAGE}
    return [
        "--model-preset", "tiny",
        "--device", "cpu", "--max-total-tokens", "2048", "--page-size", str(PAGE),
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    ]


def generate(server: ServerProcess, ids: list[int]) -> dict[str, Any]:
    payload = {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    response = httpx.post(f"{server.url}/generate", json=payload, timeout=60.0)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def flush(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/flush_cache", timeout=60.0)
    assert response.status_code == 200, response.text


def test_two_servers_share_pages_through_one_master(
    tmp_path: Path, mooncake_master: MasterProcess, mooncake_extra: dict[str, Any]
) -> None:
    args = server_args(mooncake_extra)
    with ServerProcess(args, tmp_path / "a.log", startup_timeout_s=120) as a, \
            ServerProcess(args, tmp_path / "b.log", startup_timeout_s=120) as b:
        cold = generate(a, PROMPT)
        assert cold["meta_info"]["cached_tokens"] == 0
        flush(a)  # drains A's backups to Mooncake
        from_a = generate(b, PROMPT)
        assert from_a["meta_info"]["cached_tokens_details"] == {
            "device": 0, "host": 0, "storage": REUSED}
        assert from_a["output_ids"] == cold["output_ids"]

        other = [7, *PROMPT[::-1]]  # and back: B computes, A reads
        b_cold = generate(b, other)
        flush(b)
        from_b = generate(a, other)
        assert from_b["meta_info"]["cached_tokens_details"]["storage"] == REUSED
        assert from_b["output_ids"] == b_cold["output_ids"]
