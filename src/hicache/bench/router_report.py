"""``hicache bench router``'s results: one run per policy and repeat, pooled per policy.

A policy's repeats are pooled: throughput is their tokens over their summed durations, TTFT
statistics and the tier shares are over all their successful requests. The issue's two targets
(tier_aware at least 1.3x round_robin's throughput, at least 25% lower mean TTFT than
cache_aware) are checked on the pooled results. ``write_report`` writes ``router_bench.md``
and ``router_bench.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.aggregate import LoadAverage, RunResult, aggregates, runs_table
from hicache.bench.client import TIERS
from hicache.bench.report import RequestRecord, RunSummary, Stats, markdown_table
from hicache.bench.ttft_prediction import Prediction, PredictionCheck, prediction_table
from hicache.bench.ttft_split import split_table, ttft_split
from hicache.bench.turn_placement import Placement

TARGET_THROUGHPUT_RATIO = 1.3
TARGET_TTFT_REDUCTION = 0.25


@dataclass
class PolicyRun:
    policy: str
    repeat: int
    stem: str
    summary: RunSummary | None = None
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    load_before: LoadAverage | None = None
    load_after: LoadAverage | None = None
    worker_requests: list[float] = field(default_factory=list)  # in worker order
    # Later turns sent to the worker of the turn before (``turn_placement.py``); None: not
    # known (no worker logs, or requests without ids).
    placement: Placement | None = None
    # Our router's predicted and measured TTFT per streamed decision (``ttft_prediction.py``);
    # empty for another router.
    predictions: list[Prediction] = field(default_factory=list, repr=False)

    def result(self) -> RunResult | None:
        if self.summary is None:
            return None
        return RunResult(
            self.policy, self.repeat, self.summary, self.records, self.load_before,
            self.load_after,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "repeat": self.repeat, "run": self.stem,
            "error": self.error, "notes": self.notes, "load_before": self.load_before,
            "load_after": self.load_after, "worker_requests": self.worker_requests,
            "summary": None if self.summary is None else self.summary.to_json(),
            "placement": None if self.placement is None else asdict(self.placement),
            "prediction": asdict(PredictionCheck.of(self.predictions))
            if self.predictions else None,
        }


@dataclass(frozen=True)
class PolicyResult:
    """A policy's runs pooled: throughput over their summed durations, TTFT and tier
    shares over all their successful requests."""

    policy: str
    runs: int
    requests: int
    failed: int
    total_throughput: float  # prompt (cached included) + output tokens per second
    output_throughput: float
    ttft_s: Stats | None
    tier_share: dict[str, float]  # device / host / storage / recomputed: of prompt tokens
    worker_requests: list[float]  # summed over the runs, in worker order

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "runs": self.runs, "requests": self.requests,
            "failed": self.failed, "total_throughput": self.total_throughput,
            "output_throughput": self.output_throughput,
            "ttft_s": None if self.ttft_s is None else vars(self.ttft_s),
            "tier_share": self.tier_share, "worker_requests": self.worker_requests,
        }


def tier_share(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Of the successful requests' prompt tokens: the share each tier served, and the
    share recomputed (neither cached nor reported by tier)."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    if prompt == 0:
        return {**dict.fromkeys(TIERS, 0.0), "recomputed": 0.0}
    share = {
        tier: sum((r.cached_by_tier or {}).get(tier, 0) for r in ok) / prompt for tier in TIERS
    }
    cached = sum(r.cached_tokens or 0 for r in ok)
    share["recomputed"] = max(0.0, 1.0 - cached / prompt)
    return share


def policy_results(runs: Sequence[PolicyRun]) -> list[PolicyResult]:
    results = [res for r in runs if (res := r.result()) is not None]
    out = []
    for agg in aggregates(results):
        mine = [r for r in runs if r.policy == agg.name and r.summary is not None]
        counts = [r.worker_requests for r in mine if r.worker_requests]
        summed = [sum(c[i] for c in counts) for i in range(len(counts[0]))] if counts else []
        out.append(PolicyResult(
            policy=agg.name, runs=agg.runs, requests=agg.requests, failed=agg.failed,
            total_throughput=agg.total_throughput, output_throughput=agg.output_throughput,
            ttft_s=agg.ttft_s,
            tier_share=tier_share([rec for r in mine for rec in r.records]),
            worker_requests=summed,
        ))
    return out


@dataclass(frozen=True)
class Target:
    description: str
    value: float | None  # the measured ratio
    met: bool | None  # None: a side did not run

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


def targets(results: Sequence[PolicyResult]) -> list[Target]:
    """The issue's two targets, from the pooled results."""
    by = {r.policy: r for r in results}
    tier, rr, ca = by.get("tier_aware"), by.get("round_robin"), by.get("cache_aware")
    out = []
    ratio = (
        tier.total_throughput / rr.total_throughput
        if tier and rr and rr.total_throughput > 0 else None
    )
    out.append(Target(
        f"tier_aware throughput >= {TARGET_THROUGHPUT_RATIO:g}x round_robin's", ratio,
        None if ratio is None else ratio >= TARGET_THROUGHPUT_RATIO,
    ))
    reduction = (
        1 - tier.ttft_s.mean / ca.ttft_s.mean
        if tier and ca and tier.ttft_s and ca.ttft_s and ca.ttft_s.mean > 0 else None
    )
    out.append(Target(
        f"tier_aware mean TTFT >= {100 * TARGET_TTFT_REDUCTION:.0f}% lower than cache_aware's",
        reduction, None if reduction is None else reduction >= TARGET_TTFT_REDUCTION,
    ))
    return out


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _ms(stats: Stats | None, attr: str) -> float | None:
    return None if stats is None else float(getattr(stats, attr)) * 1000


def results_table(results: Sequence[PolicyResult]) -> str:
    headers = [
        "policy", "runs", "requests", "failed", "total tok/s", "output tok/s",
        "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "device", "host", "L3", "recomputed",
        "requests per worker",
    ]
    rows = [
        [
            r.policy, r.runs, r.requests, r.failed, r.total_throughput, r.output_throughput,
            _ms(r.ttft_s, "mean"), _ms(r.ttft_s, "p50"), _ms(r.ttft_s, "p99"),
            _pct(r.tier_share["device"]), _pct(r.tier_share["host"]),
            _pct(r.tier_share["storage"]), _pct(r.tier_share["recomputed"]),
            " / ".join(f"{c:.0f}" for c in r.worker_requests) or None,
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def targets_table(rows_in: Sequence[Target]) -> str:
    rows = []
    for t in rows_in:
        if t.value is None:
            rows.append([t.description, None, "not measured (a policy did not run)"])
            continue
        shown = f"{t.value:.2f}x" if "throughput" in t.description else _pct(t.value)
        rows.append([t.description, shown, "met" if t.met else "NOT met"])
    return markdown_table(["target", "measured", "status"], rows)


def write_report(runs: Sequence[PolicyRun], out_dir: Path, header: Sequence[str]) -> Path:
    results = policy_results(runs)
    goals = targets(results)
    run_results = [res for r in runs if (res := r.result()) is not None]
    lines = [
        "# hicache bench router", "", *header, "",
        "## Per policy", "",
        "Throughput: prompt (cached included) + output tokens over the runs' summed "
        "durations. Tier columns: share of prompt tokens served from each worker's device "
        "(L1), host (L2), the shared L3, and recomputed. Requests per worker: each worker's "
        "own counter (warm-up included), in worker order.", "",
        results_table(results) if results else "(no results)", "",
        "## Targets", "", targets_table(goals), "",
        "## Runs in order", "",
        "Load average (1/5/15 min) when the workload started (the cluster up) and ended.", "",
        runs_table(run_results) if run_results else "(no results)", "",
        "## Where the TTFT went", "",
        "Means per run: the client's TTFT, the worker's own (arrival to first token) and "
        "the rest outside it (router, network); of the requests a tier beyond the device "
        "offered part of the prompt (reported), the worker's time queued before an "
        "admission round considered them, held (L3 pages still being read, or no device "
        "room), and computed (admission to first token). bench/ttft_split.py.", "",
        split_table([(r.stem, ttft_split(r.records)) for r in runs if r.records])
        if any(r.records for r in runs) else "(no results)", "",
        "## How well the router predicted TTFT", "",
        "Our router's decisions of streamed requests (its /decisions): the predicted TTFT "
        "of the worker it chose against what it measured (sent to the worker until the "
        "first byte). Error: measured - predicted. bench/ttft_prediction.py.", "",
        prediction_table([(r.stem, PredictionCheck.of(r.predictions))
                          for r in runs if r.predictions])
        if any(r.predictions for r in runs) else "(no decisions: another router)", "",
    ]
    status = [
        [r.stem, "ok" if r.error is None else "FAILED",
         "; ".join([*([r.error.splitlines()[0]] if r.error else []), *r.notes]) or None]
        for r in runs
    ]
    lines += ["## Status", "", markdown_table(["run", "status", "notes"], status), ""]
    for run in runs:
        if run.error is not None:
            lines += [f"### {run.stem}: error", "", "```", run.error, "```", ""]
    md = out_dir / "router_bench.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    (out_dir / "router_bench.json").write_text(json.dumps({
        "header": list(header),
        "policies": [r.to_json() for r in results],
        "targets": [t.to_json() for t in goals],
        "runs": [r.to_json() for r in runs],
    }, indent=2) + "\n", encoding="utf-8")
    return md
