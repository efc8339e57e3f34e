"""The raw-AIBrix baseline of ``hicache bench storage``, and the bench with the aibrix backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.bench.aibrix_baseline import LABEL, aibrix_baseline
from hicache.config import MemLayout
from tests.bench_storage_checks import (
    assert_baseline_refuses_the_file_backend,
    assert_read_into_the_targets,
    assert_reported_next_to_baseline,
    assert_timed_each_repeat,
    bench_workload,
    tiny_bench_result,
)
from tests.dev_dependency import require_dev_dependency

require_dev_dependency("aibrix_kvcache", "pip install 'hicache[aibrix]' (see scripts/bootstrap.sh)")

from hicache.storage.backends.aibrix.backend import AibrixBackend  # noqa: E402 - after the dependency check


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_baseline_moves_the_workloads_pages_through_aibrix_s_manager(
    layout: MemLayout, tmp_path: Path
) -> None:
    load = bench_workload(layout, tmp_path)
    backend = AibrixBackend(
        {"path": str(tmp_path / "l3"), "l1_capacity": "16MiB", "timeout_per_token_ms": 1000}
    )
    backend.attach(load.host)
    try:
        run = aibrix_baseline(load, backend)
        assert run.label == LABEL
        assert_timed_each_repeat(run, load)
        assert_read_into_the_targets(load)
        assert backend.stats().pages_written == 0  # the backend itself stored nothing
        assert backend.exists(load.keys) == 0
    finally:
        backend.close()


def test_the_baseline_needs_the_aibrix_backend(tmp_path: Path) -> None:
    assert_baseline_refuses_the_file_backend(aibrix_baseline, "aibrix", tmp_path)


def test_bench_storage_reports_aibrix_next_to_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tiny_bench_result(
        tmp_path, "--backends", "aibrix", "--page-size", "16", "--num-pages", "12",
        "--batch-pages", "5", "--dir", str(tmp_path),
    )
    assert_reported_next_to_baseline(result, capsys.readouterr().out, "aibrix", 12)
