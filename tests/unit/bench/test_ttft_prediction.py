"""The router's TTFT predictions against what it measured, read from its /decisions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.ttft_prediction import (
    Prediction,
    PredictionCheck,
    prediction_table,
    predictions,
    read_predictions,
)


def decision(predicted: float | None, measured: float | None, *, stream: bool = True,
             room: float | None = 0.0) -> dict[str, object]:
    terms: dict[str, float] = {"queue_s": 0.1, "own_s": 0.2}
    if room is not None:
        terms["room_s"] = room
    return {"id": 1, "rid": "r", "stream": stream, "predicted_ttft_s": predicted,
            "measured_ttft_s": measured, "terms": terms}


def test_only_streamed_decisions_with_both_figures_are_checked() -> None:
    found = predictions([
        decision(0.5, 1.0, room=0.3),
        decision(0.5, 1.0, stream=False),  # its first byte came with the whole answer
        decision(0.5, None),  # no answer yet
        decision(None, 1.0),  # a policy that predicts nothing
        decision(0.4, 0.2, room=None),  # a router from before the room term
        "not a decision",
        {"stream": True, "predicted_ttft_s": True, "measured_ttft_s": 1.0},
    ])
    assert found == [Prediction(0.5, 1.0, 0.3), Prediction(0.4, 0.2, 0.0)]


def test_the_check_reads_the_median_ratio_the_bias_and_the_room_priced() -> None:
    check = PredictionCheck.of([
        Prediction(0.5, 1.0, 0.3),  # 2x, +0.5
        Prediction(1.0, 1.0, 0.0),  # 1x, 0
        Prediction(2.0, 1.0, 0.0),  # 0.5x, -1.0
    ])
    assert check.decisions == 3 and check.priced_room == 1
    assert check.median_ratio == pytest.approx(1.0)
    assert check.mean_error_s == pytest.approx(-0.5 / 3)
    assert check.mean_abs_error_s == pytest.approx(0.5)
    # One outlier moves the mean, not the median.
    skewed = PredictionCheck.of([Prediction(1.0, 1.0, 0.0)] * 2 + [Prediction(0.1, 9.0, 0.0)])
    assert skewed.median_ratio == pytest.approx(1.0)
    assert skewed.mean_abs_error_s == pytest.approx(8.9 / 3)


def test_no_decisions_check_as_unknown() -> None:
    empty = PredictionCheck.of([])
    assert (empty.decisions, empty.median_ratio, empty.mean_error_s,
            empty.mean_abs_error_s) == (0, None, None, None)
    # A zero prediction has no ratio but still an error.
    zero = PredictionCheck.of([Prediction(0.0, 0.3, 0.0)])
    assert zero.median_ratio is None and zero.mean_error_s == pytest.approx(0.3)


def test_read_from_a_saved_decisions_answer(tmp_path: Path) -> None:
    path = tmp_path / "router-decisions.json"
    path.write_text(json.dumps({"decisions": [decision(0.5, 0.6), decision(0.5, None)]}))
    assert read_predictions(path) == [Prediction(0.5, 0.6, 0.0)]
    # Another router has no /decisions: no file; a torn file reads as nothing too.
    assert read_predictions(tmp_path / "missing.json") == []
    path.write_text('{"decisions": [')
    assert read_predictions(path) == []


def test_the_table_shows_milliseconds() -> None:
    table = prediction_table([("tier_aware", PredictionCheck.of([Prediction(0.5, 1.0, 0.2)]))])
    row = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert row == ["tier_aware", "1", "2", "500", "500", "1"]
