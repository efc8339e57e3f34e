"""The raw-Mooncake baseline of ``hicache bench storage``, against a real master."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.bench import storage as bench_storage
from hicache.bench.mooncake_baseline import LABEL, LABEL_REGIONS, mooncake_baseline
from hicache.bench.storage import Workload
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError
from hicache.storage.file import FileBackend
from hicache.storage.mooncake import MooncakeBackend
from hicache.storage.mooncake_master import MasterProcess
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    extra_fixture,
    master_fixture,
)

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PAGE_SIZE = 16
NUM_PAGES = 24


def workload(layout: MemLayout, tmp_path: Path) -> Workload:
    host = HostPool(GEOMETRY, 2 * NUM_PAGES, PAGE_SIZE, layout, pin_memory=False)
    source = np.arange(NUM_PAGES, dtype=np.int64)
    target = np.arange(NUM_PAGES, 2 * NUM_PAGES, dtype=np.int64)
    shape = (NUM_PAGES, GEOMETRY.num_layers, GEOMETRY.kv_planes, PAGE_SIZE, GEOMETRY.row_elems)
    generator = torch.Generator().manual_seed(1)
    host.pages[torch.from_numpy(source)] = torch.randn(shape, generator=generator).to(
        GEOMETRY.dtype
    )
    keys = [i.to_bytes(16, "little") for i in range(NUM_PAGES)]
    return Workload(GEOMETRY, host, keys, source, target, 10, 2, tmp_path)


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_baseline_moves_the_workloads_pages_through_the_raw_client(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend, layout: MemLayout,
    tmp_path: Path,
) -> None:
    load = workload(layout, tmp_path)
    backend = MooncakeBackend(mooncake_extra)
    backend.attach(load.host)
    try:
        run = mooncake_baseline(load, backend)
        assert len(run.put_s) == len(run.get_s) == 2
        assert all(t > 0 for t in run.put_s + run.get_s)
        assert run.label == (LABEL if layout is MemLayout.PAGE_FIRST else LABEL_REGIONS)
        pages = load.host.pages
        assert torch.equal(
            pages[torch.from_numpy(load.target)].view(torch.uint8),
            pages[torch.from_numpy(load.source)].view(torch.uint8),
        )
        # Its objects are removed afterwards, and the backend's store is untouched.
        assert backend.stats().pages_written == 0
        assert backend.exists(load.keys) == 0
    finally:
        backend.close()


def test_the_baseline_needs_the_mooncake_backend(tmp_path: Path) -> None:
    load = workload(MemLayout.PAGE_FIRST, tmp_path)
    backend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(load.host)
    try:
        with pytest.raises(StorageError, match="needs the mooncake backend"):
            mooncake_baseline(load, backend)
    finally:
        backend.close()


def test_bench_storage_reports_mooncake_next_to_the_raw_baseline(
    mooncake_master: MasterProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    bench_storage.add_arguments(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args([
        "--backends", "mooncake", "--mooncake-master", mooncake_master.address,
        "--preset", "tiny", "--page-size", "16", "--num-pages", "12", "--batch-pages", "5",
        "--repeats", "1", "--json", str(out),
    ])
    assert bench_storage.main(args) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == {}
    rows = {(r["backend"], r["op"]): r for r in result["results"]}
    assert set(rows) == {
        ("mooncake", "put"), ("mooncake", "get"),
        ("mooncake baseline", "put"), ("mooncake baseline", "get"),
    }
    assert all(r["bytes"] == 12 * result["page_bytes"] for r in rows.values())
    table = capsys.readouterr().out
    assert "| mooncake | put |" in table and "| mooncake | get |" in table
