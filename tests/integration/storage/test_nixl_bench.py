"""``hicache bench storage --backends nixl``: the backend next to raw NIXL transfers."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import MemLayout
from tests.bench_storage_checks import (
    assert_baseline_refuses_the_file_backend,
    assert_read_into_the_targets,
    assert_reported_next_to_baseline,
    assert_timed_each_repeat,
    bench_workload,
    tiny_bench_result,
)
from tests.nixl_fixtures import require_nixl

require_nixl()

from hicache.bench.nixl_baseline import nixl_baseline  # noqa: E402
from hicache.storage.backends.nixl.backend import NixlBackend  # noqa: E402


@pytest.mark.parametrize(
    ("layout", "direct_io"),
    [(MemLayout.PAGE_FIRST, False), (MemLayout.LAYER_FIRST, False), (MemLayout.LAYER_FIRST, True)],
)
def test_the_baseline_moves_the_workloads_pages_through_raw_nixl(
    tmp_path: Path, layout: MemLayout, direct_io: bool
) -> None:
    load = bench_workload(layout, tmp_path)
    backend = NixlBackend({"path": str(tmp_path / "l3"), "direct_io": direct_io})
    backend.attach(load.host)
    try:
        # The baseline zeroes the target pages first and checks what it read back.
        run = nixl_baseline(load, backend)
        assert_timed_each_repeat(run, load)
        assert_read_into_the_targets(load)
        assert run.label.startswith("raw NIXL POSIX transfers (auto queue")
        assert ("O_DIRECT" in run.label) == direct_io
        assert list(tmp_path.iterdir()) == [tmp_path / "l3"]  # its files are gone
    finally:
        backend.close()


def test_the_baseline_needs_the_nixl_backend(tmp_path: Path) -> None:
    assert_baseline_refuses_the_file_backend(nixl_baseline, "nixl", tmp_path)


def test_a_tiny_bench_run_reports_nixl_next_to_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tiny_bench_result(
        tmp_path, "--backends", "nixl", "--page-size", "4", "--num-pages", "6",
        "--batch-pages", "4", "--nixl-io-queue", "uring", "--dir", str(tmp_path / "work"),
    )
    assert_reported_next_to_baseline(result, capsys.readouterr().out, "nixl", 6)
    assert list((tmp_path / "work").iterdir()) == []
