"""Repeated runs of ``hicache bench compare``: per-run rows, aggregates, ratios to a baseline.

With ``--repeats N`` every configuration (and the external baseline) runs N
times, alternating, in one session. A configuration's aggregate pools its runs:
throughput is the tokens of all its runs over the sum of their durations, and the
TTFT statistics are over all their requests together. Ratios divide a hicache
configuration's aggregate by the baseline's (both measured in the same session,
interleaved, so slow drifts of a shared machine hit both sides alike); the
per-repeat ratios pair the i-th run of each side, which ran next to each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hicache.bench.report import RequestRecord, RunSummary, Stats, markdown_table

LoadAverage = tuple[float, float, float]


@dataclass(frozen=True)
class RunResult:
    """One finished run as the aggregates see it."""

    name: str  # the configuration (or baseline) name, shared by its repeats
    repeat: int  # 1-based
    summary: RunSummary
    records: Sequence[RequestRecord]
    load_before: LoadAverage | None = None
    load_after: LoadAverage | None = None


def total_throughput(summary: RunSummary) -> float:
    """Prompt (cached included) plus output tokens per second."""
    return summary.input_throughput + summary.output_throughput


@dataclass(frozen=True)
class Aggregate:
    name: str
    runs: int
    requests: int
    failed: int
    duration_s: float  # summed over the runs
    prompt_tokens: int  # of the successful requests of all runs
    output_tokens: int
    output_throughput: float
    total_throughput: float
    ttft_s: Stats | None  # over every successful request of every run
    output_throughput_runs: tuple[float, ...]  # each run's, in order

    @classmethod
    def of(cls, name: str, results: Sequence[RunResult]) -> Aggregate:
        duration = math.fsum(r.summary.duration_s for r in results)
        ok = [rec for r in results for rec in r.records if rec.ok]
        prompt = sum(rec.prompt_tokens for rec in ok)
        output = sum(rec.output_tokens for rec in ok)
        return cls(
            name=name,
            runs=len(results),
            requests=sum(r.summary.overall.requests for r in results),
            failed=sum(r.summary.overall.failed for r in results),
            duration_s=duration,
            prompt_tokens=prompt,
            output_tokens=output,
            output_throughput=output / duration if duration > 0 else 0.0,
            total_throughput=(prompt + output) / duration if duration > 0 else 0.0,
            ttft_s=Stats.of(rec.ttft_s for rec in ok if rec.ttft_s is not None),
            output_throughput_runs=tuple(r.summary.output_throughput for r in results),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def aggregates(results: Sequence[RunResult]) -> list[Aggregate]:
    """One aggregate per name, in the order the names first ran."""
    names = list(dict.fromkeys(r.name for r in results))
    return [Aggregate.of(n, [r for r in results if r.name == n]) for n in names]


@dataclass(frozen=True)
class Ratios:
    """``name`` / ``baseline``: > 1 is better for throughput, < 1 for TTFT."""

    name: str
    baseline: str
    output_throughput: float | None
    total_throughput: float | None
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    output_throughput_per_repeat: tuple[float, ...]  # run i of name / run i of baseline

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _stat(stats: Stats | None, attr: str) -> float | None:
    return None if stats is None else float(getattr(stats, attr))


def ratios(
    results: Sequence[RunResult], baseline: str, names: Sequence[str]
) -> list[Ratios]:
    """Each of ``names`` against ``baseline``, from the runs of this session."""
    by_name = {a.name: a for a in aggregates(results)}
    base = by_name.get(baseline)
    if base is None:
        return []
    base_runs = {r.repeat: r.summary for r in results if r.name == baseline}
    out: list[Ratios] = []
    for name in names:
        agg = by_name.get(name)
        if agg is None:
            continue
        paired = [
            r.summary.output_throughput / base_runs[r.repeat].output_throughput
            for r in results
            if r.name == name and r.repeat in base_runs
            and base_runs[r.repeat].output_throughput > 0
        ]
        out.append(Ratios(
            name=name, baseline=baseline,
            output_throughput=_div(agg.output_throughput, base.output_throughput),
            total_throughput=_div(agg.total_throughput, base.total_throughput),
            ttft_mean=_div(_stat(agg.ttft_s, "mean"), _stat(base.ttft_s, "mean")),
            ttft_p50=_div(_stat(agg.ttft_s, "p50"), _stat(base.ttft_s, "p50")),
            ttft_p99=_div(_stat(agg.ttft_s, "p99"), _stat(base.ttft_s, "p99")),
            output_throughput_per_repeat=tuple(paired),
        ))
    return out


def workload_mismatches(
    aggs: Sequence[Aggregate], baseline: str, tolerance: float = 0.01
) -> list[str]:
    """Warnings for configurations whose requests carried other token counts than the
    baseline's: the two sides then did not run the same workload (answers of other
    lengths, or re-encoded from text, make the next rounds' prompts differ)."""
    by_name = {a.name: a for a in aggs}
    base = by_name.get(baseline)
    if base is None or base.failed or not base.runs:
        return []
    warnings = []
    for agg in aggs:
        if agg.name == baseline or agg.failed or not agg.runs:
            continue
        for what, ours, theirs in (
            ("prompt", agg.prompt_tokens / agg.runs, base.prompt_tokens / base.runs),
            ("output", agg.output_tokens / agg.runs, base.output_tokens / base.runs),
        ):
            if abs(ours - theirs) > tolerance * max(theirs, 1):
                warnings.append(
                    f"{agg.name} got {ours:.0f} {what} tokens a run, {baseline} {theirs:.0f}: "
                    "the two sides did not run the same workload"
                )
    return warnings


# ------------------------------------------------------------------------ tables
def _ms(stats: Stats | None, attr: str) -> float | None:
    value = _stat(stats, attr)
    return None if value is None else value * 1000


def _load(load: LoadAverage | None) -> str | None:
    return None if load is None else " ".join(f"{x:.2f}" for x in load)


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def runs_table(results: Sequence[RunResult]) -> str:
    """Every run in the order it ran, with the machine's load average around it."""
    headers = [
        "#", "run", "load before (1/5/15 min)", "load after", "requests", "failed",
        "prompt tokens", "output tokens", "duration s", "output tok/s", "total tok/s",
        "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms",
    ]
    rows = []
    for i, r in enumerate(results, 1):
        s, g = r.summary, r.summary.overall
        rows.append([
            i, s.label, _load(r.load_before), _load(r.load_after), g.requests, g.failed,
            g.prompt_tokens, g.output_tokens, s.duration_s, s.output_throughput,
            total_throughput(s), _ms(g.ttft_s, "mean"), _ms(g.ttft_s, "p50"),
            _ms(g.ttft_s, "p99"),
        ])
    return markdown_table(headers, rows)


def aggregates_table(aggs: Sequence[Aggregate]) -> str:
    headers = [
        "config", "runs", "requests", "failed", "output tok/s", "total tok/s",
        "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "output tok/s per run",
    ]
    rows = [
        [
            a.name, a.runs, a.requests, a.failed, a.output_throughput, a.total_throughput,
            _ms(a.ttft_s, "mean"), _ms(a.ttft_s, "p50"), _ms(a.ttft_s, "p99"),
            ", ".join(f"{v:.3g}" for v in a.output_throughput_runs),
        ]
        for a in aggs
    ]
    return markdown_table(headers, rows)


def ratios_table(rows_in: Sequence[Ratios]) -> str:
    headers = [
        "config / baseline", "output tok/s", "total tok/s", "TTFT mean", "TTFT p50",
        "TTFT p99", "output tok/s per repeat",
    ]
    rows = [
        [
            f"{r.name} / {r.baseline}", _x(r.output_throughput), _x(r.total_throughput),
            _x(r.ttft_mean), _x(r.ttft_p50), _x(r.ttft_p99),
            ", ".join(f"{v:.2f}x" for v in r.output_throughput_per_repeat) or None,
        ]
        for r in rows_in
    ]
    return markdown_table(headers, rows)
