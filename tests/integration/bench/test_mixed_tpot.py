"""`hicache bench mixed-tpot` on CPU with the tiny model: it runs each setting, and the
budgeted one cuts the long prompt into more steps inside the prefill window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main


def test_mixed_tpot_reports_each_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mixed.json"
    code = main([
        "bench", "mixed-tpot", "--device", "cpu", "--delays-ms", "off,0.001,x1",
        "--decoders", "2", "--decode-tokens", "48", "--prompts", "1", "--prompt-tokens", "256",
        "--chunked-prefill-size", "128", "--repeats", "1", "--json", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| setting | decode TPOT in prefill window ms |" in printed
    assert "greedy outputs differ" not in printed
    samples = {s["setting"]: s for s in json.loads(out.read_text())}
    assert set(samples) == {"off", "0.001", "x1"}
    assert all(s["decode_tpot_ms"] > 0 and s["prompt_ttft_ms"] > 0 for s in samples.values())
    # A delay too tight for any chunk: 16-token steps against 128-token ones.
    assert samples["0.001"]["window_steps"] > samples["off"]["window_steps"]
