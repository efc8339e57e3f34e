"""`hicache bench load-vs-recompute` on CPU with the tiny model: one row per length and
throttle point (and per length and host point for the host tier), a slow store or a slow
host->device path makes loading slower, and a load answers with the tokens its recompute
did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.memory.geometry import TINY

TOKENS = [64, 256]
PAGE = 16
# A store far slower than the tiny model computes: each read waits at least this long.
SLOW_LATENCY_MS = 150.0


def test_each_row_measures_load_and_recompute_and_a_slow_store_loads_slower(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lvr.json"
    code = main([
        "bench", "load-vs-recompute", "--model-preset", "tiny", "--device", "cpu",
        "--tokens", *map(str, TOKENS), "--points", "0:none", f"{SLOW_LATENCY_MS:g}:1MB",
        "--repeats", "2", "--page-size", str(PAGE), "--json", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "| tier | tokens | latency ms | bandwidth | recompute s | load s |" in table
    rows = json.loads(out.read_text())
    assert [(r["tier"], r["tokens"], r["read_bandwidth"]) for r in rows] == [
        ("storage", 64, None), ("storage", 256, None),
        ("storage", 64, "1MB"), ("storage", 256, "1MB"),
        ("host", 64, None), ("host", 256, None),
    ]
    for r in rows:
        assert r["cached_tokens"] == (r["tokens"] - 1) // PAGE * PAGE
        assert len(r["load_samples"]) == len(r["recompute_samples"]) == 2
        assert r["load_s"] > 0 and r["recompute_s"] > 0
        assert r["ratio"] == pytest.approx(r["load_s"] / r["recompute_s"])
        assert r["best_s"] == min(r["load_s"], r["recompute_s"])
        assert r["same_output"]  # loaded KV answers as recomputed KV
    fast = {r["tokens"]: r for r in rows if r["tier"] == "storage" and not r["read_bandwidth"]}
    slow = {r["tokens"]: r for r in rows if r["read_bandwidth"] == "1MB"}
    for tokens in TOKENS:
        # The throttle's wait is the feature: at least its latency, and over the free store.
        assert slow[tokens]["load_s"] >= SLOW_LATENCY_MS / 1000
        assert slow[tokens]["load_s"] > fast[tokens]["load_s"]
    # By the last rows the cost model has learned the prefill and the store's reads.
    assert slow[TOKENS[-1]]["predicted_recompute_s"] is not None
    assert slow[TOKENS[-1]]["predicted_load_s"] is not None


def test_host_points_throttle_the_host_rows_loads_and_leave_the_l3_rows_at_full_speed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lvr.json"
    tokens = TOKENS[-1]
    code = main([
        "bench", "load-vs-recompute", "--model-preset", "tiny", "--device", "cpu",
        "--tokens", str(tokens), "--points", "0:none",
        "--host-points", "0:none", f"{SLOW_LATENCY_MS:g}:1MB",
        "--repeats", "2", "--page-size", str(PAGE), "--json", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert f"| L2 | {tokens} | {SLOW_LATENCY_MS:g} | 1MB |" in table
    assert f"| L2 | {tokens} | 0 | unlimited |" in table
    rows = json.loads(out.read_text())
    assert [(r["tier"], r["read_latency_ms"], r["read_bandwidth"]) for r in rows] == [
        ("storage", 0.0, None), ("host", 0.0, None), ("host", SLOW_LATENCY_MS, "1MB"),
    ]
    _, fast, slow = rows
    for r in rows:
        assert r["cached_tokens"] == (tokens - 1) // PAGE * PAGE
        assert r["same_output"]  # a throttled load answers as the recompute did
    # The throttle's wait is the feature: each throttled load waits at least its latency
    # plus the hit's bytes at 1 MB/s.
    page_bytes = TINY.page_bytes(PAGE)  # the tiny preset's KV geometry
    floor = SLOW_LATENCY_MS / 1000 + slow["cached_tokens"] // PAGE * page_bytes / 1e6
    assert min(slow["load_samples"]) >= floor
    assert slow["load_s"] > fast["load_s"]
    # The warm-up taught the cost model the throttled loads.
    assert slow["predicted_load_s"] is not None
