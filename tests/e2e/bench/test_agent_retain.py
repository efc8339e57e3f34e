"""``hicache bench agent-retain``: its flag checks and a smoke run.

The smoke run plays two tiny-model sessions, each pause filled with more unrelated
prompts than the worker's L1 + L2 hold, once without hints and once with a ``retain``
hint on every session turn (``hicache_hints``), each on a fresh worker. It checks
what must hold even that small: no request failed, every resume was measured, each
session turn of the hints variant got its retain hint's outcome and the other none,
and the ratio is the one the raw counts give. The 1.5x target is for the full-size run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main

SESSIONS, TURNS, FILLERS = 2, 3, 4


def test_bad_flags_fail_before_any_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    for flags, message in (
        (["--variants", "hints,pin"], "pin is not one of none, hints"),
        (["--turns", "1"], "--turns >= 2"),
        (["--fillers-per-pause", "-1"], "--fillers-per-pause must be >= 0"),
        (["--hicache-ratio", "1"], "--hicache-ratio > 1"),
        (["--retain-ttl-s", "0"], "--retain-ttl-s must be > 0"),
        (["--turns", "20"], "more than --max-total-tokens 1024"),
        (["--filler-tokens", "1024"], "--filler-tokens must leave room for an answer"),
    ):
        assert main(["bench", "agent-retain", "--out", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_smoke_run_with_and_without_retain_hints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ar.json"
    code = main([
        "bench", "agent-retain", "--model", "tiny", "--out", str(out),
        "--sessions", str(SESSIONS), "--turns", str(TURNS), "--first-prompt-tokens", "128",
        "--turn-tokens", "32", "--output-tokens", "4", "--fillers-per-pause", str(FILLERS),
        "--filler-tokens", "256", "--max-total-tokens", "512", "--hicache-ratio", "2",
        "--retain-ttl-s", "300", "--startup-timeout", "180",
    ])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0, report
    # The pauses are sized past L1 + L2: the plan does not warn otherwise.
    assert not any(note.startswith("WARNING") for note in report["config"]["notes"])
    none, hints = report["variants"]
    assert (none["variant"], hints["variant"]) == ("none", "hints")
    for variant in (none, hints):
        assert variant["error"] is None and variant["failed"] == 0, variant
        assert variant["resume"]["requests"] == SESSIONS * (TURNS - 1)
        assert variant["first_turns"]["requests"] == SESSIONS
        assert variant["fillers"]["requests"] == SESSIONS * TURNS * FILLERS
    assert none["hint_outcomes"] == {}
    # One outcome per session turn, each for its retain hint (fillers carry none).
    assert sum(hints["hint_outcomes"].values()) == SESSIONS * TURNS, hints["hint_outcomes"]
    assert all(key.startswith("retain/") for key in hints["hint_outcomes"])
    with_hints, without = hints["resume"]["cached_tokens"], none["resume"]["cached_tokens"]
    if without:
        assert report["resume_cached_ratio"] == pytest.approx(with_hints / without)
    else:
        assert report["resume_cached_ratio"] is None
    assert report["target_met"] == (with_hints >= 1.5 * without and with_hints > 0)
    assert "hints / none" in printed and (tmp_path / "ar.json.runs" / "hints").is_dir()
