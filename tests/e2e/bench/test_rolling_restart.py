"""``hicache bench rolling-restart``: its flag checks and a smoke run.

The smoke run restarts two tiny-model workers behind a real ``hicache router`` (drain
mode) under a few seconds of conversations and checks what must hold even that small:
no request failed, each drained worker exited 0, the report has every window and the
after/before ratio is the one its raw counts give. The performance target (the cached
share after the restarts >= 0.8 of before) is for the full-size run, not checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main

WINDOWS = {"warmup", "before", "restart", "after"}


def test_bad_flags_fail_before_any_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    for flags, message in (
        (["--modes", "drain,pause"], "pause is not one of drain, kill"),
        (["--num-workers", "0"], "--num-workers must be >= 1"),
        (["--in-flight", "0"], "--conversations and --in-flight must be >= 1"),
        (["--before-s", "-1"], "must be >= 0"),
        (["--hicache-ratio", "1"], "--hicache-ratio must be > 1"),
        (["--max-rounds", "0"], "rounds must be >= 1"),
        (["--max-rounds", "20"], "last round needs 1920 tokens (prompt and answer), more "
                                 "than --max-total-tokens 1024"),
    ):
        assert main(["bench", "rolling-restart", "--out", str(out), "--max-total-tokens",
                     "1024", *flags]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "out.json.runs").exists()


def test_smoke_run_drains_every_worker_behind_the_router(tmp_path: Path) -> None:
    out = tmp_path / "rr.json"
    code = main([
        "bench", "rolling-restart", "--model", "tiny", "--num-workers", "2",
        "--mode", "drain", "--out", str(out), "--conversations", "2", "--in-flight", "2",
        "--first-prompt-tokens", "64", "--round-tokens", "16", "--output-tokens", "4",
        "--max-rounds", "4", "--warmup-s", "1", "--before-s", "3", "--after-s", "3",
        "--max-total-tokens", "512", "--startup-timeout", "180",
    ])
    report = json.loads(out.read_text())
    assert code == 0, report
    (run,) = report["runs"]
    assert run["mode"] == "drain" and run["error"] is None
    assert set(run["windows"]) == WINDOWS
    assert run["failed"] == sum(w["failed"] for w in run["windows"].values()) == 0
    before, after = run["windows"]["before"], run["windows"]["after"]
    assert before["requests"] > 0 and after["requests"] > 0
    for window in (before, after):
        assert window["cached_share"] == pytest.approx(
            window["cached_tokens"] / window["prompt_tokens"])
        assert sum(window["cached_by_tier"].values()) <= window["cached_tokens"]
    assert run["cached_share_ratio"] == pytest.approx(
        after["cached_share"] / before["cached_share"])
    assert run["target_met"] == (run["cached_share_ratio"] >= 0.8)  # reported, not required
    assert [r["worker"] for r in run["restarts"]] == [0, 1]
    assert all(r["exit_code"] == 0 for r in run["restarts"]), run["restarts"]
    assert all(r["total_s"] >= r["stop_s"] > 0 for r in run["restarts"])
    logs = tmp_path / "rr.json.runs" / "drain"
    for index in range(2):
        assert "drain done" in (logs / f"worker-{index}.log").read_text()
        assert (logs / f"worker-{index}.restarted.log").is_file()
    assert not (logs / "l3").exists()  # the run's L3 pages are removed after it
