"""``hicache bench storage --backends nixl``: the backend next to raw NIXL transfers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.bench import storage as bench_storage
from hicache.bench.storage import Workload
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.file import FileBackend
from tests.nixl_fixtures import require_nixl

require_nixl()

from hicache.bench.nixl_baseline import nixl_baseline  # noqa: E402
from hicache.storage.nixl import NixlBackend  # noqa: E402

# Regions of 16 tokens x 256-byte rows = 4096 bytes: direct I/O works too.
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


@pytest.mark.parametrize(
    ("layout", "direct_io"),
    [(MemLayout.PAGE_FIRST, False), (MemLayout.LAYER_FIRST, False), (MemLayout.LAYER_FIRST, True)],
)
def test_the_baseline_moves_the_workloads_pages_through_raw_nixl(
    tmp_path: Path, layout: MemLayout, direct_io: bool
) -> None:
    load = workload(layout, tmp_path)
    backend = NixlBackend({"path": str(tmp_path / "l3"), "direct_io": direct_io})
    backend.attach(load.host)
    try:
        # The baseline zeroes the target pages first and checks what it read back.
        run = nixl_baseline(load, backend)
        assert len(run.put_s) == len(run.get_s) == 2
        assert all(t > 0 for t in run.put_s + run.get_s)
        assert run.label.startswith("raw NIXL POSIX transfers (auto queue")
        assert ("O_DIRECT" in run.label) == direct_io
        read = load.host.pages[torch.from_numpy(load.target)]
        assert torch.equal(read, load.host.pages[torch.from_numpy(load.source)])
        assert list(tmp_path.iterdir()) == [tmp_path / "l3"]  # its files are gone
    finally:
        backend.close()


def test_the_baseline_needs_the_nixl_backend(tmp_path: Path) -> None:
    load = workload(MemLayout.PAGE_FIRST, tmp_path)
    backend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(load.host)
    with pytest.raises(StorageError, match="needs the nixl backend, not file"):
        nixl_baseline(load, backend)


def test_a_tiny_bench_run_reports_nixl_next_to_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench_storage.add_arguments(parser)
    out = tmp_path / "results.json"
    args = parser.parse_args([
        "--backends", "nixl", "--preset", "tiny", "--page-size", "4", "--num-pages", "6",
        "--batch-pages", "4", "--repeats", "1", "--nixl-io-queue", "uring",
        "--dir", str(tmp_path / "work"), "--json", str(out),
    ])
    assert bench_storage.main(args) == 0
    results = json.loads(out.read_text())
    assert results["skipped"] == {}
    measured = {(r["backend"], r["op"]) for r in results["results"]}
    assert measured == {
        ("nixl", "put"), ("nixl", "get"), ("nixl baseline", "put"), ("nixl baseline", "get"),
    }
    assert "| nixl | put |" in capsys.readouterr().out
    assert list((tmp_path / "work").iterdir()) == []
