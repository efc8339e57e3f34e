"""The raw-Mooncake baseline of ``hicache bench storage``, against a real master."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache.bench.mooncake_baseline import LABEL, LABEL_REGIONS, mooncake_baseline
from hicache.config import MemLayout
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.testing.mooncake_master import MasterProcess
from tests.bench_storage_checks import (
    assert_baseline_refuses_the_file_backend,
    assert_read_into_the_targets,
    assert_reported_next_to_baseline,
    assert_timed_each_repeat,
    bench_workload,
    tiny_bench_result,
)
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    extra_fixture,
    master_fixture,
)


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_baseline_moves_the_workloads_pages_through_the_raw_client(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend, layout: MemLayout,
    tmp_path: Path,
) -> None:
    load = bench_workload(layout, tmp_path)
    backend = MooncakeBackend(mooncake_extra)
    backend.attach(load.host)
    try:
        run = mooncake_baseline(load, backend)
        assert_timed_each_repeat(run, load)
        assert_read_into_the_targets(load)
        assert run.label == (LABEL if layout is MemLayout.PAGE_FIRST else LABEL_REGIONS)
        # Its objects are removed afterwards, and the backend's store is untouched.
        assert backend.stats().pages_written == 0
        assert backend.exists(load.keys) == 0
    finally:
        backend.close()


def test_the_baseline_needs_the_mooncake_backend(tmp_path: Path) -> None:
    assert_baseline_refuses_the_file_backend(mooncake_baseline, "mooncake", tmp_path)


def test_bench_storage_reports_mooncake_next_to_the_raw_baseline(
    mooncake_master: MasterProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    result = tiny_bench_result(
        tmp_path, "--backends", "mooncake", "--mooncake-master", mooncake_master.address,
        "--page-size", "16", "--num-pages", "12", "--batch-pages", "5",
    )
    assert_reported_next_to_baseline(result, capsys.readouterr().out, "mooncake", 12)


def test_bench_storage_puts_sealed_pages_into_a_peer_processs_segment(
    mooncake_master: MasterProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--mooncake-segment peer: this process lends nothing, so every page (plain and
    sealed, each read back and compared by the bench) went to the peer's segment."""
    result = tiny_bench_result(
        tmp_path, "--backends", "mooncake", "--mooncake-master", mooncake_master.address,
        "--mooncake-segment", "peer", "--encryption-keys", "random", "--alternations", "1",
        "--page-size", "16", "--num-pages", "12", "--batch-pages", "5",
    )
    table = capsys.readouterr().out
    assert result["mooncake_segment"] == "peer"
    assert "mooncake pages in a peer process's segment" in table
    rows = {(r["backend"], r["op"]) for r in result["results"]}
    assert {("mooncake sealed", "put"), ("mooncake sealed", "get")} <= rows
    assert set(result["sealed_over_plain"]) == {"mooncake put", "mooncake get"}
