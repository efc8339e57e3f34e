"""``hicache bench storage --backends lmcache`` and its plain baseline, against a real server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.bench import storage as bench_storage
from hicache.bench.lmcache_baseline import lmcache_baseline
from hicache.bench.storage import Workload
from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.file import FileBackend
from hicache.storage.lmcache_server import ServerProcess
from tests.lmcache_fixtures import GEOMETRY, server_fixture  # noqa: F401 - a fixture


def test_bench_storage_reports_lmcache_next_to_its_baseline(
    lmcache_server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    bench_storage.add_arguments(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args([
        "--backends", "lmcache", "--lmcache-url", lmcache_server.url, "--preset", "tiny",
        "--page-size", "16", "--num-pages", "12", "--batch-pages", "5", "--repeats", "1",
        "--layout", "layer_first", "--json", str(out),
    ])
    assert bench_storage.main(args) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == {}
    rows = {(r["backend"], r["op"]): r for r in result["results"]}
    assert set(rows) == {
        ("lmcache", "put"), ("lmcache", "get"),
        ("lmcache baseline", "put"), ("lmcache baseline", "get"),
    }
    assert all(r["bytes"] == 12 * result["page_bytes"] for r in rows.values())
    table = capsys.readouterr().out
    assert "| lmcache | put |" in table and "| lmcache | get |" in table


def test_the_baseline_needs_the_lmcache_backend(tmp_path: Path) -> None:
    host = HostPool(GEOMETRY, 4, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    pages = np.arange(2, dtype=np.int64)
    load = Workload(
        GEOMETRY, host, [bytes(16), bytes(15) + b"\1"], pages, pages + 2, 2, 1, tmp_path
    )
    host.pages[torch.from_numpy(pages)] = 1.0
    backend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(host)
    try:
        with pytest.raises(StorageError, match="needs the lmcache backend"):
            lmcache_baseline(load, backend)
    finally:
        backend.close()
