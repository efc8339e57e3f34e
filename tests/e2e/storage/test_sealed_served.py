"""Real ``hicache serve`` processes over a real redis-server and a real mooncake_master
with --l3-encryption-keys: a second server with the same key file answers a tenant's
prompt from the pages the first sealed, with the first's greedy tokens; a tenant the file
gives no key is never stored and still answered; a bad key file stops the server with exit
code 2 naming its line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.testing.server_process import ServerProcess
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    master_fixture,
)
from tests.redis_fixtures import extra_fixture as redis_extra_fixture  # noqa: F401
from tests.redis_fixtures import server_fixture  # noqa: F401 - a fixture
from tests.waiting import wait_until

FLAGS = ["--model-preset", "tiny", "--device", "cpu", "--max-total-tokens", "1024",
         "--page-size", "16", "--hicache-storage-prefetch-policy", "wait_complete",
         "--hicache-reuse-policy", "load"]
STORE = {"prefetch_threshold": 16, "io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
PROMPT = [(5 * i + 1) % 256 for i in range(200)]  # 12 whole pages
START_S = 180.0


def generate(client: httpx.Client, tenant: str) -> dict[str, Any]:
    body = {"input_ids": PROMPT, "extra_key": tenant,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_servers_sharing_a_sealed_store(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest,
) -> None:
    extra: dict[str, Any] = request.getfixturevalue(f"{backend}_extra")
    keys = tmp_path / "keys"
    keys.write_text(f"acme 1 {'a1' * 32}\n")
    keys.chmod(0o600)
    flags = [*FLAGS, "--hicache-storage-backend", backend,
             "--hicache-storage-backend-extra-config", json.dumps({**extra, **STORE}),
             "--l3-encryption-keys", str(keys)]
    # Both up at once: a Mooncake server's pages live in the memory it lends the pool.
    with ServerProcess(flags, tmp_path / "first.log", startup_timeout_s=START_S) as first, \
            ServerProcess(flags, tmp_path / "second.log", startup_timeout_s=START_S) as second, \
            httpx.Client(base_url=first.url, timeout=60.0) as client, \
            httpx.Client(base_url=second.url, timeout=60.0) as other_client:
        cold = {tenant: generate(client, tenant)["output_ids"] for tenant in ("acme", "globex")}
        # acme's pages reach Redis (sealed); globex has no key: refused, counted.
        assert wait_until(
            lambda: metric(client, "hicache_l3_backup_pages_stored_total") >= 12, 30.0
        ), "acme's pages were not stored"
        assert wait_until(
            lambda: metric(client, "hicache_l3_failures_total", reason="no_key") >= 1, 30.0
        ), "globex's refused backup was not counted"
        warm = generate(other_client, "acme")
        assert warm["meta_info"]["cached_tokens_details"]["storage"] == 192
        assert warm["output_ids"] == cold["acme"]
        other = generate(other_client, "globex")
        assert other["meta_info"]["cached_tokens_details"]["storage"] == 0
        assert other["output_ids"] == cold["globex"]
        assert metric(other_client, "hicache_l3_failures_total", reason="bad_tag") == 0


def test_a_bad_key_file_stops_the_server(tmp_path: Path, redis_extra: dict[str, Any]) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated\nacme 1 {'a1' * 32}\nacme 1 {'a2' * 32}\n")
    server = ServerProcess(
        [*FLAGS, "--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config",
         json.dumps(redis_extra), "--l3-encryption-keys", str(keys)], tmp_path / "serve.log",
    )
    server.launch()  # not awaited: it is to exit at start-up
    assert server.process is not None
    try:
        code = server.process.wait(timeout=START_S)
    finally:
        server.kill()
    log = server.log_text()
    assert code == 2, log
    assert f"{keys}:3: duplicate key id 1 for tenant 'acme' (first on line 2)" in log
