"""`hicache bench storage --backends redis` and its raw redis-py baseline, on a real server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from hicache.bench import storage as bench_storage
from hicache.bench.redis_baseline import LABEL, redis_baseline
from hicache.bench.storage import Workload
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.file import FileBackend
from hicache.storage.redis import RedisBackend
from hicache.storage.redis_server import RedisServerProcess
from tests.redis_fixtures import extra_fixture, server_fixture  # noqa: F401 - fixtures

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PAGE_SIZE = 16
NUM_PAGES = 24


def workload(layout: MemLayout, tmp_path: Path) -> Workload:
    host = HostPool(GEOMETRY, 2 * NUM_PAGES, PAGE_SIZE, layout, pin_memory=False)
    source = np.arange(NUM_PAGES, dtype=np.int64)
    target = np.arange(NUM_PAGES, 2 * NUM_PAGES, dtype=np.int64)
    shape = (NUM_PAGES, GEOMETRY.num_layers, 2, PAGE_SIZE, GEOMETRY.row_elems)
    generator = torch.Generator().manual_seed(1)
    host.pages[torch.from_numpy(source)] = torch.randn(shape, generator=generator).to(
        GEOMETRY.dtype
    )
    keys = [i.to_bytes(16, "little") for i in range(NUM_PAGES)]
    return Workload(GEOMETRY, host, keys, source, target, 10, 2, tmp_path)


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_baseline_moves_the_workloads_pages_through_the_raw_client(
    redis_extra: dict[str, Any], layout: MemLayout, tmp_path: Path,
) -> None:
    load = workload(layout, tmp_path)
    backend = RedisBackend(redis_extra)
    backend.attach(load.host)
    try:
        client = backend.raw_client
        keys_before = client.dbsize()
        run = redis_baseline(load, backend)  # raises if the bytes read back differ
        assert len(run.put_s) == len(run.get_s) == 2
        assert all(t > 0 for t in run.put_s + run.get_s)
        assert run.label == LABEL
        # Its keys are deleted afterwards, and the backend's pages are untouched.
        assert client.dbsize() == keys_before
        assert backend.stats().pages_written == 0
        assert backend.exists(load.keys) == 0
    finally:
        backend.close()


def test_the_baseline_needs_the_redis_backend(tmp_path: Path) -> None:
    load = workload(MemLayout.PAGE_FIRST, tmp_path)
    backend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(load.host)
    try:
        with pytest.raises(StorageError, match="needs the redis backend"):
            redis_baseline(load, backend)
    finally:
        backend.close()


def bench_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_storage.add_arguments(parser)
    return parser.parse_args([
        "--backends", "redis", "--preset", "tiny", "--page-size", "16", "--num-pages", "12",
        "--batch-pages", "5", "--repeats", "1", "--json", str(tmp_path / "result.json"),
        *extra,
    ])


@pytest.mark.parametrize("own_server", [False, True])
def test_bench_storage_reports_redis_next_to_the_raw_baseline(
    redis_server: RedisServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    own_server: bool,
) -> None:
    """With --redis-url it uses that server (and leaves no key there); without, it starts one."""
    client = redis.Redis.from_url(redis_server.url)
    keys_before = client.dbsize()
    args = bench_args(tmp_path) if own_server else bench_args(
        tmp_path, "--redis-url", redis_server.url
    )
    assert bench_storage.main(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["skipped"] == {}
    rows = {(r["backend"], r["op"]): r for r in result["results"]}
    assert set(rows) == {
        ("redis", "put"), ("redis", "get"), ("redis baseline", "put"), ("redis baseline", "get"),
    }
    assert all(r["bytes"] == 12 * result["page_bytes"] for r in rows.values())
    table = capsys.readouterr().out
    assert "| redis | put |" in table and "| redis | get |" in table
    assert client.dbsize() == keys_before
    client.close()
