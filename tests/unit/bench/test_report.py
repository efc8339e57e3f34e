"""Statistics, summaries, JSON/JSONL round trips, markdown tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.bench.client import RequestResult
from hicache.bench.plots import plot_runs
from hicache.bench.report import (
    GroupSummary,
    JsonlLog,
    RequestRecord,
    RunSummary,
    Stats,
    comparison_table,
    format_summary,
    markdown_table,
    percentile,
    read_jsonl,
)
from hicache.cli import main as cli_main


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60),
    st.floats(0, 100),
)
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    ordered = sorted(values)
    assert percentile(ordered, q) == pytest.approx(
        float(np.percentile(ordered, q)), rel=1e-9, abs=1e-6
    )


def test_stats_of_known_values() -> None:
    stats = Stats.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert stats == Stats(count=5, mean=3.0, p50=3.0, p90=4.6, p99=pytest.approx(4.96), max=5.0)
    assert Stats.of([]) is None
    single = Stats.of([7.0])
    assert single is not None and single.p99 == single.p50 == single.max == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def record(
    session: int, round_: int, sent: float, latency: float, ttft: float | None, prompt: int,
    cached: int | None, tiers: dict[str, int] | None = None, ok: bool = True, out: int = 4,
    itl: tuple[float, ...] = (0.01, 0.02, 0.03),
) -> RequestRecord:
    return RequestRecord(
        session=session, round=round_, group=0, sent_s=sent, ok=ok, latency_s=latency,
        ttft_s=ttft, ttft_from_content=True, itl_s=list(itl), prompt_tokens=prompt,
        output_tokens=out if ok else 0, cached_tokens=cached, cached_by_tier=tiers,
        finish_reason="length" if ok else None, error=None if ok else "HTTP 500: boom",
    )


def sample_records() -> list[RequestRecord]:
    return [
        record(0, 0, 0.0, 1.0, 0.5, 100, 0, {"device": 0, "host": 0, "storage": 0}),
        record(1, 0, 0.5, 1.5, 0.7, 100, 0, {"device": 0, "host": 0, "storage": 0}),
        record(0, 1, 1.0, 1.0, 0.1, 200, 150, {"device": 100, "host": 50, "storage": 0}),
        record(1, 1, 2.0, 2.0, 0.3, 200, 100, {"device": 0, "host": 60, "storage": 40}),
        record(2, 0, 2.5, 0.1, None, 50, None, None, ok=False),
    ]


def test_summary_accounts_tokens_hits_and_failures() -> None:
    summary = RunSummary.of("run", sample_records())
    g = summary.overall
    assert (g.requests, g.failed) == (5, 1)
    # Only successful requests count: 4 of them.
    assert g.prompt_tokens == 600 and g.output_tokens == 16 and g.cached_tokens == 250
    assert g.hit_rate == pytest.approx(250 / 600)
    assert g.tier_hit_rate == pytest.approx({"device": 100 / 600, "host": 110 / 600,
                                             "storage": 40 / 600})
    assert g.ttft_s is not None and g.ttft_s.count == 4 and g.ttft_s.mean == pytest.approx(0.4)
    assert g.itl_s is not None and g.itl_s.count == 12
    # Wall time: first send (0.0) to last end (2.0 + 2.0 = 4.0).
    assert summary.duration_s == pytest.approx(4.0)
    assert summary.input_throughput == pytest.approx(600 / 4.0)
    assert summary.prefill_throughput == pytest.approx(350 / 4.0)
    assert summary.output_throughput == pytest.approx(16 / 4.0)
    assert summary.request_throughput == pytest.approx(4 / 4.0)
    assert len(summary.rounds) == 2
    assert summary.rounds[0].requests == 3 and summary.rounds[0].hit_rate == 0.0
    assert summary.rounds[1].hit_rate == pytest.approx(250 / 400)


def test_no_cache_reports_mean_unknown_hit_rate() -> None:
    group = GroupSummary.of([record(0, 0, 0.0, 1.0, 0.5, 10, None)])
    assert group.hit_rate is None and group.tier_hit_rate is None
    empty = RunSummary.of("empty", [])
    assert empty.duration_s == 0 and empty.input_throughput == 0 and empty.rounds == []


def test_summary_json_round_trip(tmp_path: Path) -> None:
    summary = RunSummary.of("run", sample_records(), {"num_clients": 2})
    path = tmp_path / "out" / "run.json"
    summary.save(path)
    assert RunSummary.load(path) == summary
    data = json.loads(path.read_text())
    assert summary.overall.ttft_s is not None
    assert data["overall"]["ttft_s"]["p90"] == summary.overall.ttft_s.p90
    assert data["config"] == {"num_clients": 2}


def test_jsonl_log_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "requests.jsonl"
    records = sample_records()
    with JsonlLog(path) as log:
        for r in records:
            log.write(r)
        # Written as it goes: readable before the log is closed.
        assert len(path.read_text().splitlines()) == len(records)
    assert read_jsonl(path) == records
    with JsonlLog(None) as nowhere:
        nowhere.write(records[0])  # no file: a no-op


def test_record_from_result_prefers_the_servers_prompt_count() -> None:
    result = RequestResult(ok=True, sent_at=10.5, latency_s=1.0, ttft_s=0.2, prompt_tokens=None)
    assert RequestRecord.of(0, 0, 0, result, 10.0, client_prompt_tokens=33).prompt_tokens == 33
    result.prompt_tokens = 34
    rec = RequestRecord.of(1, 2, 3, result, 10.0, client_prompt_tokens=33)
    assert (rec.prompt_tokens, rec.session, rec.round, rec.group) == (34, 1, 2, 3)
    assert rec.sent_s == pytest.approx(0.5) and rec.ended_s == pytest.approx(1.5)


def test_markdown_tables() -> None:
    table = markdown_table(["a", "bb"], [[1, None], [0.123456, 12345.6]])
    lines = table.splitlines()
    assert lines[0] == "| a     | bb    |"
    assert lines[1] == "| ----- | ----- |"
    assert lines[2] == "| 1     | -     |"
    assert lines[3] == "| 0.123 | 12346 |"

    base = RunSummary.of("no-cache", [record(0, 0, 0.0, 2.0, 1.0, 100, 0)])
    fast = RunSummary.of("l1", [record(0, 0, 0.0, 1.0, 0.25, 100, 80)])
    text = comparison_table([base, fast])
    rows = [line.split("|") for line in text.splitlines()]
    header = [c.strip() for c in rows[0]]
    l1 = [c.strip() for c in rows[3]]
    assert l1[header.index("input tok/s vs no-cache")] == "2.00x"
    assert l1[header.index("TTFT vs no-cache")] == "-75.0%"
    assert l1[header.index("hit rate")] == "80.0%"
    assert comparison_table([]) == "(no runs)"


def test_format_summary_mentions_the_key_figures() -> None:
    text = format_summary(RunSummary.of("my-run", sample_records()))
    assert "## my-run" in text and "5 (1 failed)" in text
    assert "41.7%" in text  # overall hit rate
    assert "host 18.3%" in text
    assert "| TTFT ms" in text and "| round" in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    a = RunSummary.of("a", sample_records())
    b = RunSummary.of("b", [record(0, 0, 0.0, 1.0, 0.2, 100, None)])
    out = plot_runs([a, b], tmp_path / "plots" / "runs.png", title="two runs")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    with pytest.raises(ValueError):
        plot_runs([], tmp_path / "none.png")


def test_plot_cli(tmp_path: Path) -> None:
    paths = []
    for name in ("x", "y"):
        path = tmp_path / f"{name}.json"
        RunSummary.of(name, sample_records()).save(path)
        paths.append(str(path))
    out = tmp_path / "cli.png"
    assert cli_main(["bench", "plot", *paths, "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["bench", "plot", str(bad), "-o", str(out)]) == 2
