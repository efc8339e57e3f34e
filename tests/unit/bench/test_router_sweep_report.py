"""The sweep's report: issue 34's targets evaluated on hand-built results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.router_sweep_report import (
    ContenderStats,
    PointResult,
    SweepState,
    evaluate,
    summary_table,
    write_sweep_report,
)


def stats(name: str, kind: str, throughput: float, mean: float | None, p99: float | None,
          requests: int = 10) -> ContenderStats:
    return ContenderStats(name, kind, 1, requests, 0, throughput, mean, p99, 1.0,
                          {"device": 0.25, "host": 0.25, "storage": 0.25, "recomputed": 0.25})


OURS = "hicache-tier_aware"


def test_every_target_met_at_the_bounds() -> None:
    e = evaluate(stats(OURS, "hicache", 120.0, 0.8, 2.0),
                 [stats("sglang", "sglang", 100.0, 1.0, 2.0)], tiers_matter=True)
    assert e.throughput_ratio == pytest.approx(1.2)
    assert e.ttft_mean_ratio == pytest.approx(0.8) and e.ttft_p99_ratio == pytest.approx(1.0)
    assert (e.throughput_tiers, e.throughput_any, e.ttft_mean, e.ttft_p99) == (
        True, True, True, True)
    assert e.all_met()


def test_each_target_misses_on_its_own() -> None:
    theirs = [stats("sglang", "sglang", 100.0, 1.0, 2.0)]
    e = evaluate(stats(OURS, "hicache", 110.0, 0.81, 2.01), theirs, tiers_matter=True)
    assert (e.throughput_tiers, e.throughput_any, e.ttft_mean, e.ttft_p99) == (
        False, True, False, False)
    assert not e.all_met()
    slower = evaluate(stats(OURS, "hicache", 99.0, 0.5, 1.0), theirs, tiers_matter=True)
    assert (slower.throughput_tiers, slower.throughput_any, slower.ttft_mean,
            slower.ttft_p99) == (False, False, True, True)


def test_the_1_2x_target_applies_only_where_the_tiers_matter() -> None:
    theirs = [stats("sglang", "sglang", 100.0, 1.0, 2.0)]
    e = evaluate(stats(OURS, "hicache", 110.0, 0.5, 1.0), theirs, tiers_matter=False)
    assert e.throughput_tiers is None and e.throughput_any is True and e.all_met()


def test_open_loop_points_evaluate_ttft_only() -> None:
    theirs = [stats("sglang", "sglang", 100.0, 1.0, 2.0)]
    e = evaluate(stats(OURS, "hicache", 99.0, 0.5, 1.0), theirs, tiers_matter=True,
                 closed_loop=False)
    assert e.throughput_ratio == pytest.approx(0.99)
    assert e.throughput_tiers is None and e.throughput_any is None and e.all_met()


def test_sglang_is_held_at_its_best_setting_per_metric() -> None:
    theirs = [stats("sglang", "sglang", 100.0, 1.0, 1.5),
              stats("sglang-tuned", "sglang", 150.0, 2.0, 3.0)]
    e = evaluate(stats(OURS, "hicache", 165.0, 0.8, 1.5), theirs, tiers_matter=True)
    assert e.throughput_ratio == pytest.approx(1.1)  # against the tuned one's throughput
    assert e.ttft_mean_ratio == pytest.approx(0.8)  # against the defaults' mean
    assert e.ttft_p99_ratio == pytest.approx(1.0)  # against the defaults' p99


def test_an_unmeasured_side_meets_nothing() -> None:
    e = evaluate(stats(OURS, "hicache", 0.0, None, None, requests=0),
                 [stats("sglang", "sglang", 100.0, 1.0, 2.0)], tiers_matter=True)
    assert e.throughput_ratio is None and e.ttft_mean is None and not e.all_met()
    alone = evaluate(stats(OURS, "hicache", 100.0, 1.0, 2.0), [], tiers_matter=True)
    assert alone.throughput_any is None and alone.ttft_p99 is None and not alone.all_met()


def _point(point_id: str, arrival: str, ours: ContenderStats) -> PointResult:
    sizes = {"l1_tokens": 768, "l2_tokens": 1536, "num_clients": 29, "num_rounds": 4,
             "request_length": 256, "sub_question_length": 64, "output_length": 8,
             "working_set_tokens": 29 * 480, "l3_max_bytes": None, "max_inflight": 6}
    return PointResult(
        point_id, {"prompt": "short", "ws": 2.0, "l3": "all", "arrival": arrival}, sizes,
        None if arrival == "closed" else 2.0, 4.0,
        [ours, stats("sglang", "sglang", 100.0, 1.0, 2.0)], [])


def test_the_summary_counts_each_target_over_the_points_evaluated(tmp_path: Path) -> None:
    results = [
        _point("a-closed", "closed", stats(OURS, "hicache", 130.0, 0.7, 1.9)),
        _point("b-closed", "closed", stats(OURS, "hicache", 105.0, 0.7, 2.5)),
        _point("b-poisson50", "poisson50", stats(OURS, "hicache", 100.0, 0.7, 1.0)),
    ]
    assert all(r.tiers_matter for r in results)
    table = summary_table(results)
    row = next(line for line in table.splitlines() if OURS in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 1.2x and 1.0x on the two closed points; TTFT on all three; all: a-closed, b-poisson50.
    assert cells == [OURS, "1 / 2", "2 / 2", "3 / 3", "2 / 3", "2 / 3"]
    state = SweepState(tmp_path / "router_sweep.json", {})
    for result in results:
        state.record(result)
    md = write_sweep_report(state, ["b-closed", "a-closed"], tmp_path, ["- header line"])
    text = md.read_text()
    assert text.index("| b-closed") < text.index("| a-closed") < text.index("| b-poisson50")
    assert "NOT met" in text and "- header line" in text
    assert (tmp_path / "router_sweep.png").stat().st_size > 0


def test_the_points_table_shows_the_share_of_turns_kept_on_their_worker() -> None:
    from dataclasses import asdict, replace

    from hicache.bench.router_sweep_report import points_table

    def last_cell(point: PointResult) -> str:
        row = next(line for line in points_table([point]).splitlines() if OURS in line)
        return [c.strip() for c in row.strip().strip("|").split("|")][-1]

    ours = replace(stats(OURS, "hicache", 100.0, 1.0, 2.0), kept_share=0.62)
    point = _point("a-closed", "closed", ours)
    point.contenders[1] = replace(point.contenders[1], kept_share=0.97)
    assert last_cell(point) == "62 / 97"
    # A state file written before the share was kept reads as unknown, shown as "-".
    old = {k: v for k, v in asdict(ours).items() if k != "kept_share"}
    assert ContenderStats.from_json(old).kept_share is None
    assert last_cell(_point("b-closed", "closed", ContenderStats.from_json(old))) == "-"


def test_the_report_shows_how_well_our_router_predicted(tmp_path: Path) -> None:
    from dataclasses import asdict, replace

    from hicache.bench.router_sweep_report import predictions_table
    from hicache.bench.ttft_prediction import Prediction, PredictionCheck

    check = PredictionCheck.of([Prediction(0.5, 1.0, 0.0), Prediction(1.0, 1.5, 0.4)])
    ours = replace(stats(OURS, "hicache", 100.0, 1.0, 2.0), prediction=check)
    point = _point("a-closed", "closed", ours)
    table = predictions_table([point])
    assert f"a-closed {OURS}" in table and "sglang" not in table  # SGLang logs none
    # Kept through the sweep's state file; one written before reads as unknown.
    assert ContenderStats.from_json(json.loads(json.dumps(asdict(ours)))) == ours
    old = {k: v for k, v in asdict(ours).items() if k != "prediction"}
    assert ContenderStats.from_json(old).prediction is None
    assert predictions_table([_point("b", "closed", ContenderStats.from_json(old))]) == (
        "(no decisions logged)")
