"""Where a run's time to first token went, from what the client measured and what the
workers said of their own part (``RequestRecord.server_ttft_s`` and ``.reuse``).

- outside: the client's TTFT less the worker's (arrival to first token): the router,
  the network, the client's own loop;
- of the requests a tier beyond the device offered part of the prompt (they carry the
  worker's load-or-recompute report): held, from when the worker first priced the
  request's L3 pages to its admission (pages still being read, or no device room
  beside the requests running there); computed, admission to first token (loads and
  prefill); queued, the rest of the worker's TTFT (arrival to the first admission round
  that considered it: the forwards ahead of it).

Means over the successful requests that have each figure; None where none has it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hicache.bench.report import RequestRecord, markdown_table


@dataclass(frozen=True)
class TTFTSplit:
    requests: int  # successful requests with a TTFT
    ttft_s: float | None  # the client's mean
    server_ttft_s: float | None  # the worker's own, where it said
    outside_s: float | None
    reported: int  # requests with the worker's reuse report
    queued_s: float | None
    held_s: float | None
    computed_s: float | None


def _mean(values: Iterable[float]) -> float | None:
    found = list(values)
    return statistics.fmean(found) if found else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def ttft_split(records: Iterable[RequestRecord]) -> TTFTSplit:
    done = [r for r in records if r.ok and r.ttft_s is not None]
    served = [r for r in done if r.server_ttft_s is not None]
    parts: list[tuple[float, float, float]] = []  # (queued, held, computed)
    for r in served:
        reuse = r.reuse or {}
        computed = _number(reuse.get("actual_s"))
        if computed is None:
            continue
        held = _number(reuse.get("waited_s")) or 0.0
        assert r.server_ttft_s is not None
        parts.append((max(0.0, r.server_ttft_s - held - computed), held, computed))
    return TTFTSplit(
        requests=len(done),
        ttft_s=_mean(r.ttft_s for r in done if r.ttft_s is not None),
        server_ttft_s=_mean(r.server_ttft_s for r in served if r.server_ttft_s is not None),
        outside_s=_mean(r.ttft_s - r.server_ttft_s for r in served
                        if r.ttft_s is not None and r.server_ttft_s is not None),
        reported=len(parts),
        queued_s=_mean(p[0] for p in parts),
        held_s=_mean(p[1] for p in parts),
        computed_s=_mean(p[2] for p in parts),
    )


def _ms(value: float | None) -> float | None:
    return None if value is None else 1000 * value


def split_table(rows: Sequence[tuple[str, TTFTSplit]]) -> str:
    headers = ["run", "requests", "TTFT ms", "worker's ms", "outside ms", "reported",
               "queued ms", "held ms", "computed ms"]
    return markdown_table(headers, [
        [name, s.requests, _ms(s.ttft_s), _ms(s.server_ttft_s), _ms(s.outside_s), s.reported,
         _ms(s.queued_s), _ms(s.held_s), _ms(s.computed_s)]
        for name, s in rows
    ])
