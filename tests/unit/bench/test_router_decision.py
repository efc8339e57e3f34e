"""``hicache bench router-decision`` on a small index: it builds, routes and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main


def test_router_decision_bench_reports_percentiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "decision.json"
    code = main(["bench", "router-decision", "--pages", "5000", "--requests", "60",
                 "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["workers"] == 8
    # The build stops at the first document past the target (at most 128 pages each).
    assert 5000 <= results["indexed_pages"] < 5000 + 4 * 128
    for name in ("tier_aware", "cache_aware", "page_hashes", "tier_aware_cpu"):
        row = results[name]
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    printed = capsys.readouterr().out
    assert "tier_aware choose" in printed and "target tier_aware p99" in printed
