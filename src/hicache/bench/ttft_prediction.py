"""How well the router's TTFT model predicted a run: each decision's predicted TTFT for
the worker it chose against the TTFT the router measured for that request (its
``/decisions``, saved as ``router-decisions.json`` next to each run's log).

Only streamed requests count: a request that does not stream gets its first byte with
the whole answer, so what the router measured of it is not a TTFT (``router/decisions.py``).
Measured is the router's own (sent to the worker until its first byte), so the client's
side of the network is not in it. Accuracy is read as:

- the median of measured / predicted (1: right; above 1: slower than predicted), which one
  outlier does not move;
- the mean of measured - predicted (signed: a bias) and of its absolute value;
- how many decisions priced a wait for device room (``router/device_room.py``), to tell
  whether that term was in play.

Another router (``--router-program``) has no decisions: nothing is read for it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.bench.report import markdown_table


@dataclass(frozen=True)
class Prediction:
    predicted_s: float
    measured_s: float
    room_s: float  # the predicted wait for device room (0: none priced)


@dataclass(frozen=True)
class PredictionCheck:
    decisions: int  # streamed decisions with both a prediction and a measurement
    median_ratio: float | None  # measured / predicted
    mean_error_s: float | None  # measured - predicted
    mean_abs_error_s: float | None
    priced_room: int  # of them, those whose prediction held a wait for device room

    @classmethod
    def of(cls, predictions: Iterable[Prediction]) -> PredictionCheck:
        found = list(predictions)
        errors = [p.measured_s - p.predicted_s for p in found]
        ratios = [p.measured_s / p.predicted_s for p in found if p.predicted_s > 0]
        return cls(
            decisions=len(found),
            median_ratio=statistics.median(ratios) if ratios else None,
            mean_error_s=statistics.fmean(errors) if errors else None,
            mean_abs_error_s=statistics.fmean(abs(e) for e in errors) if errors else None,
            priced_room=sum(1 for p in found if p.room_s > 0),
        )


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def predictions(decisions: Iterable[Any]) -> list[Prediction]:
    """The checkable ones of ``/decisions``' entries (anything else in the list is skipped:
    a file from another version of the router must not break a report)."""
    found = []
    for entry in decisions:
        if not isinstance(entry, dict) or entry.get("stream") is not True:
            continue
        predicted = _number(entry.get("predicted_ttft_s"))
        measured = _number(entry.get("measured_ttft_s"))
        if predicted is None or measured is None:
            continue
        terms = entry.get("terms")
        room = _number(terms.get("room_s")) if isinstance(terms, dict) else None
        found.append(Prediction(predicted, measured, room or 0.0))
    return found


def read_predictions(path: Path) -> list[Prediction]:
    """A saved ``/decisions`` answer's predictions; [] when there is no such file (a router
    without the route) or it does not parse."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    entries = data.get("decisions") if isinstance(data, dict) else data
    return predictions(entries) if isinstance(entries, list) else []


def prediction_table(rows: Sequence[tuple[str, PredictionCheck]]) -> str:
    headers = ["run", "decisions", "median measured / predicted", "mean error ms",
               "mean abs error ms", "priced a wait for room"]
    return markdown_table(headers, [
        [name, c.decisions, c.median_ratio,
         None if c.mean_error_s is None else 1000 * c.mean_error_s,
         None if c.mean_abs_error_s is None else 1000 * c.mean_abs_error_s, c.priced_room]
        for name, c in rows
    ])
