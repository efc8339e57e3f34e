"""``hicache bench page-hash``: both ways of hashing a page run, agree, and are reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import _BENCHMARKS, main


def test_a_tiny_run_reports_both_methods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    assert main([
        "bench", "page-hash", "--geometry", "qwen3-0.6b", "--page-size", "2",
        "--num-pages", "4", "--repeats", "1", "--json", str(out),
    ]) == 0
    printed = capsys.readouterr().out
    # 2 tokens x 8 heads x 128 (bf16) = 4 KiB regions, 56 of them: 224 KiB, gathered.
    assert "gathered to hash: True" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [row["method"] for row in rows] == ["regions in place", "hash_page"]
    for row in rows:
        assert row["us_per_page"] > 0 and row["gb_per_s"] > 0 and row["beside_pace"] >= 0


def test_it_is_a_hicache_bench_subcommand() -> None:
    module, help_text = _BENCHMARKS["page-hash"]
    assert module == "hicache.bench.page_hash" and "GIL" in help_text
