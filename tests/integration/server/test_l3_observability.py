"""What an operator sees of L3 through a real server: a damaged page file shows up in
/metrics as a labelled failure and in the log, and the prefetch allowance in force is a gauge."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(30.0)
PROMPT = list(range(1, 100))  # 6 whole pages of 16 tokens
FAILURE_LOG = "hicache.storage.failure_log"


@pytest.fixture
def l3_dir(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def server(l3_dir: Path) -> Iterator[RunningServer]:
    extra = json.dumps({"path": str(l3_dir), "prefetch_threshold": PAGE,
                        "prefetch_timeout_per_ki_token": "auto"})
    args = [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "timeout",
        "--hicache-storage-backend-extra-config", extra,
    ]
    with serve_in_thread(args) as running:
        yield running


def scrape(server: RunningServer) -> dict[str, float]:
    response = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines() if line and not line.startswith("#")
    }


def generate(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    })
    assert response.status_code == 200, response.text


def damage_every_page(l3_dir: Path) -> int:
    files = [p for p in l3_dir.glob("??/*") if not p.name.startswith(".")]
    for path in files:
        data = bytearray(path.read_bytes())
        data[7] ^= 0x40  # one bit of the payload: the checksum no longer matches
        path.write_bytes(bytes(data))
    return len(files)


CORRUPT = 'hicache_l3_failures_total{reason="corrupt",source="backend"}'
ALLOWANCE = "hicache_l3_prefetch_timeout_per_ki_token_seconds"


def test_a_damaged_page_file_is_a_labelled_failure_in_metrics_and_a_warning_in_the_log(
    server: RunningServer, l3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = server.engine
    generate(server)
    assert server.wait_until(lambda: engine.metrics()["storage_backup_pages_stored"] >= 6)
    assert server.wait_idle()
    before = scrape(server)
    assert CORRUPT not in before
    assert before[ALLOWANCE] == 0.1  # auto, nothing read from L3 yet: the default
    assert damage_every_page(l3_dir) >= 6

    # Forget L1 and L2: the same prompt now has to come back from the damaged files.
    assert httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT).status_code == 200
    caplog.set_level(logging.INFO, logger=FAILURE_LOG)
    generate(server)
    assert server.wait_until(lambda: engine.metrics().get("storage_backend_failures_corrupt") == 1)

    after = scrape(server)
    # The first page failed its checksum; the read stops there (the rest is recomputed).
    assert after[CORRUPT] == 1.0
    assert after['hicache_cached_tokens_total{source="storage"}'] == 0.0
    warnings = [r.getMessage() for r in caplog.records
                if r.name == FAILURE_LOG and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "L3 file: 'corrupt' x1 (backend)" in warnings[0]
    assert "failed its checksum" in warnings[0]
    engine.check_integrity()
