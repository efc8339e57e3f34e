"""``hicache bench storage --backends lmcache`` and its plain baseline, against a real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.bench.lmcache_baseline import lmcache_baseline
from hicache.testing.lmcache_server import LMCacheServerProcess
from tests.bench_storage_checks import (
    assert_baseline_refuses_the_file_backend,
    assert_reported_next_to_baseline,
    tiny_bench_result,
)
from tests.lmcache_fixtures import GEOMETRY, server_fixture  # noqa: F401 - a fixture


def test_bench_storage_reports_lmcache_next_to_its_baseline(
    lmcache_server: LMCacheServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    result = tiny_bench_result(
        tmp_path, "--backends", "lmcache", "--lmcache-url", lmcache_server.url,
        "--page-size", "16", "--num-pages", "12", "--batch-pages", "5", "--layout", "layer_first",
    )
    assert_reported_next_to_baseline(result, capsys.readouterr().out, "lmcache", 12)


def test_the_baseline_needs_the_lmcache_backend(tmp_path: Path) -> None:
    assert_baseline_refuses_the_file_backend(lmcache_baseline, "lmcache", tmp_path)
