"""`hicache bench l2-ttft` on CPU with the tiny model: it runs, and measures what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main


def test_l2_ttft_reports_each_tier_and_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "l2.json"
    code = main([
        "bench", "l2-ttft", "--device", "cpu", "--contexts", "128,256", "--suffix", "16",
        "--repeats", "2", "--page-size", "16", "--json", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "| context | KV MB | h2d GB/s |" in table
    results = json.loads(out.read_text())
    assert [r["context_tokens"] for r in results] == [128, 256]
    for r in results:
        # tiny: 4 layers x 2 KV heads x 16 dims x K and V x fp32 = 1 KiB per token
        assert r["kv_bytes"] == r["context_tokens"] * 1024
        assert len(r["l2_samples"]) == 2 and all(s > 0 for s in r["l2_samples"])
        assert r["bound_ms"] > r["l1_ms"] > 0
        assert r["ratio"] == pytest.approx(r["l2_ms"] / r["bound_ms"])
