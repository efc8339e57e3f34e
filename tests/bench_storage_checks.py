"""What the tests of ``hicache bench storage`` share across L3 backends: a small workload for
a raw baseline, the refusal of the wrong backend, and a tiny bench run that must report the
backend next to its baseline."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.bench import page_copies
from hicache.bench import storage as bench_storage
from hicache.bench.storage import BaselineRun, Workload
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageBackend, StorageError

# Regions of 16 tokens x 256-byte rows = 4096 bytes: O_DIRECT works on them too.
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PAGE_SIZE = 16
NUM_PAGES = 24


def bench_workload(layout: MemLayout, tmp_path: Path) -> Workload:
    """NUM_PAGES random source pages to store, as many target pages to read them into."""
    host = HostPool(GEOMETRY, 2 * NUM_PAGES, PAGE_SIZE, layout, pin_memory=False)
    source = np.arange(NUM_PAGES, dtype=np.int64)
    target = np.arange(NUM_PAGES, 2 * NUM_PAGES, dtype=np.int64)
    # [pages, layers, k/v, tokens, row]
    shape = (NUM_PAGES, GEOMETRY.num_layers, GEOMETRY.kv_planes, PAGE_SIZE, GEOMETRY.row_elems)
    generator = torch.Generator().manual_seed(1)
    host.pages[torch.from_numpy(source)] = torch.randn(shape, generator=generator).to(
        GEOMETRY.dtype
    )
    keys = [i.to_bytes(16, "little") for i in range(NUM_PAGES)]
    return Workload(GEOMETRY, host, keys, source, target, 10, 2, tmp_path)


def assert_timed_each_repeat(run: BaselineRun, load: Workload) -> None:
    """Each repeat of the workload timed one put and one get."""
    assert len(run.put_s) == len(run.get_s) == load.repeats
    assert all(t > 0 for t in run.put_s + run.get_s)


def assert_read_into_the_targets(load: Workload) -> None:
    """The target pages hold the source pages' bytes (compared as bytes, whatever the dtype)."""
    pages = load.host.pages
    assert torch.equal(
        pages[torch.from_numpy(load.target)].view(torch.uint8),
        pages[torch.from_numpy(load.source)].view(torch.uint8),
    )


def assert_baseline_refuses_the_file_backend(
    baseline: Callable[[Workload, Any], object], backend_name: str, tmp_path: Path,
) -> None:
    """A raw baseline run with another backend than its own is refused by name."""
    load = bench_workload(MemLayout.PAGE_FIRST, tmp_path)
    backend: StorageBackend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(load.host)
    try:
        with pytest.raises(StorageError, match=f"needs the {backend_name} backend, not file"):
            baseline(load, backend)
    finally:
        backend.close()


def tiny_bench_result(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """Run ``hicache bench storage`` with the tiny preset, one repeat and ``flags``; its JSON."""
    parser = argparse.ArgumentParser()
    bench_storage.add_arguments(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args(
        ["--preset", "tiny", "--repeats", "1", "--json", str(out), *flags]
    )
    assert bench_storage.main(args) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["skipped"] == {}
    return result


def assert_reported_next_to_baseline(
    result: dict[str, Any], table: str, backend_name: str, num_pages: int
) -> None:
    """The run measured put and get of ``backend_name`` and of its baseline, on every page."""
    rows = {(r["backend"], r["op"]): r for r in result["results"]}
    baseline = f"{backend_name} baseline"
    # With checksums in the cache's copies (the default) the run also times those copies.
    copies = {
        (name, op)
        for name in (page_copies.NAME, f"{page_copies.NAME} baseline", page_copies.DIRECT)
        for op in ("write", "load")
    }
    if result["verify_at_get"] or not result["verify_checksum"]:
        copies = set()
    assert set(rows) == {
        (backend_name, "put"), (backend_name, "get"), (baseline, "put"), (baseline, "get"),
        *copies,
    }
    assert all(r["bytes"] == num_pages * result["page_bytes"] for r in rows.values())
    assert f"| {backend_name} | put |" in table and f"| {backend_name} | get |" in table
