"""`hicache bench storage --backends redis` and its raw redis-py baseline, on a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from hicache.bench.redis_baseline import LABEL, redis_baseline
from hicache.config import MemLayout
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.testing.redis_server import RedisServerProcess
from tests.bench_storage_checks import (
    assert_baseline_refuses_the_file_backend,
    assert_reported_next_to_baseline,
    assert_timed_each_repeat,
    bench_workload,
    tiny_bench_result,
)
from tests.redis_fixtures import extra_fixture, server_fixture  # noqa: F401 - fixtures


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_baseline_moves_the_workloads_pages_through_the_raw_client(
    redis_extra: dict[str, Any], layout: MemLayout, tmp_path: Path,
) -> None:
    load = bench_workload(layout, tmp_path)
    backend = RedisBackend(redis_extra)
    backend.attach(load.host)
    try:
        client = backend.raw_client
        keys_before = client.dbsize()
        run = redis_baseline(load, backend)  # raises if the bytes read back differ
        assert_timed_each_repeat(run, load)
        assert run.label == LABEL
        # Its keys are deleted afterwards, and the backend's pages are untouched.
        assert client.dbsize() == keys_before
        assert backend.stats().pages_written == 0
        assert backend.exists(load.keys) == 0
    finally:
        backend.close()


def test_the_baseline_needs_the_redis_backend(tmp_path: Path) -> None:
    assert_baseline_refuses_the_file_backend(redis_baseline, "redis", tmp_path)


@pytest.mark.parametrize("own_server", [False, True])
def test_bench_storage_reports_redis_next_to_the_raw_baseline(
    redis_server: RedisServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    own_server: bool,
) -> None:
    """With --redis-url it uses that server (and leaves no key there); without, it starts one."""
    client = redis.Redis.from_url(redis_server.url)
    keys_before = client.dbsize()
    server_flags = () if own_server else ("--redis-url", redis_server.url)
    result = tiny_bench_result(
        tmp_path, "--backends", "redis", "--page-size", "16", "--num-pages", "12",
        "--batch-pages", "5", *server_flags,
    )
    assert_reported_next_to_baseline(result, capsys.readouterr().out, "redis", 12)
    assert client.dbsize() == keys_before
    client.close()
