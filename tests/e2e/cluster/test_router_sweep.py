"""``hicache bench router --sweep`` end to end on one tiny point: real tiny-model workers
behind ``hicache router`` and behind SGLang's router, the point's row in the report, and a
second run that finds the point done and starts nothing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hicache.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="SGLang's router (sglang-router, a bench dependency on Linux) is not installed",
)


def test_one_point_with_both_routers_then_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # SGLang's router must not look for a tokenizer
    out = tmp_path / "out"
    flags = ["bench", "router", "--sweep", "--smoke", "--out-dir", str(out), "--num-workers", "2",
             "--startup-timeout", "180", "--sweep-ws", "0.5", "--sweep-l3", "all",
             "--sweep-arrival", "closed", "--sweep-prompt", "short",
             "--sweep-point-seconds", "30", "--sweep-kv-bytes-per-token", "1024",
             "--sweep-generations", "2"]
    code = main(flags)
    report = (out / "router_sweep.md").read_text()
    assert code == 0, report
    data = json.loads((out / "router_sweep.json").read_text())
    point = data["points"]["short-ws0.5-l3all-closed"]
    assert point["errors"] == []
    contenders = {c["name"]: c for c in point["contenders"]}
    assert list(contenders)[-1] == "sglang" and len(contenders) == 2
    conversations, rounds = point["sizes"]["num_clients"], point["sizes"]["num_rounds"]
    assert point["sizes"]["generations"] == 2
    for stats in contenders.values():
        # Every turn of both generations of conversations answered (the tiny workload ends
        # before the deadline), some of it from a cache.
        assert stats["requests"] == 2 * conversations * rounds and stats["failed"] == 0
        assert stats["tier_share"]["recomputed"] < 1.0
        # Each router's later turns were placed from the workers' access logs, whichever
        # router passed the client's request ids on.
        assert stats["kept_share"] is not None and 0.0 <= stats["kept_share"] <= 1.0
        # Our router predicted and measured each streamed turn's TTFT; SGLang's logs none.
        if stats["kind"] == "hicache":
            assert stats["prediction"]["decisions"] >= 2 * conversations * rounds, stats
        else:
            assert stats["prediction"] is None
    # The closed loop measured the point's capacity: SGLang's successful requests per second.
    assert point["capacity_rps"] == pytest.approx(contenders["sglang"]["request_rps"])
    assert point["capacity_rps"] > 0
    [evaluation] = point["evaluations"]
    assert evaluation["throughput_ratio"] > 0 and evaluation["ttft_p99_ratio"] > 0
    assert "short-ws0.5-l3all-closed" in report and (out / "router_sweep.png").is_file()
    for name in contenders:
        run_dir = out / "points" / "short-ws0.5-l3all-closed" / "runs" / name
        assert (run_dir / "router.log").is_file()
    capsys.readouterr()
    # Resumed: the point is done, nothing starts.
    assert main(flags) == 0
    assert "1 points asked, 1 already done" in capsys.readouterr().out
