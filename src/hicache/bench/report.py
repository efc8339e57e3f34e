"""Benchmark results: per-request records, their statistics, JSON/JSONL and markdown.

A run is a list of ``RequestRecord`` (one per request, also written as JSON
lines while the run goes) summarized into a ``RunSummary``: latency statistics
(mean, p50, p90, p99, max), token and request throughput over the run's wall
time, and the cache hit rate (cached prompt tokens / prompt tokens) overall, by
tier and per round. Only requests that succeeded count toward latencies and
throughput; failures are counted apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from hicache.bench.client import TIERS, RequestResult


# ------------------------------------------------------------------------ statistics
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, interpolating linearly between ranks."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats | None:
        """Statistics of ``values``; None when there are none."""
        ordered = sorted(values)
        if not ordered:
            return None
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            max=ordered[-1],
        )


# ------------------------------------------------------------------------ records
@dataclass(frozen=True)
class RequestRecord:
    """One request as logged: where it belongs, what it cost, what the cache gave."""

    session: int
    round: int
    group: int
    sent_s: float  # seconds from the start of the run
    ok: bool
    latency_s: float
    ttft_s: float | None
    ttft_from_content: bool
    itl_s: list[float]
    prompt_tokens: int  # the server's count, else the client's
    output_tokens: int
    cached_tokens: int | None
    cached_by_tier: dict[str, int] | None
    finish_reason: str | None = None
    error: str | None = None
    # What the server said of its own part (``RequestResult``): arrival to first token,
    # and its load-or-recompute report. Absent from logs written before they were kept.
    server_ttft_s: float | None = None
    reuse: dict[str, Any] | None = None
    rid: str | None = None  # the request id the client sent, where it sent one

    @classmethod
    def of(
        cls, session: int, round_: int, group: int, result: RequestResult, run_start: float,
        client_prompt_tokens: int,
    ) -> RequestRecord:
        return cls(
            session=session, round=round_, group=group, sent_s=result.sent_at - run_start,
            ok=result.ok, latency_s=result.latency_s, ttft_s=result.ttft_s,
            ttft_from_content=result.ttft_from_content, itl_s=list(result.itl_s),
            prompt_tokens=(
                result.prompt_tokens if result.prompt_tokens is not None else client_prompt_tokens
            ),
            output_tokens=result.output_tokens, cached_tokens=result.cached_tokens,
            cached_by_tier=result.cached_by_tier, finish_reason=result.finish_reason,
            error=result.error, server_ttft_s=result.server_ttft_s, reuse=result.reuse,
            rid=result.rid,
        )

    @property
    def ended_s(self) -> float:
        return self.sent_s + self.latency_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


class JsonlLog:
    """Appends one JSON line per record as requests finish (a killed run keeps its log)."""

    def __init__(self, path: str | Path | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: RequestRecord) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record.to_json()) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    with open(path, encoding="utf-8") as file:
        return [RequestRecord.from_json(json.loads(line)) for line in file if line.strip()]


# ------------------------------------------------------------------------ summaries
@dataclass(frozen=True)
class GroupSummary:
    """Statistics over a set of requests (a whole run, or one round of it)."""

    requests: int
    failed: int
    ttft_s: Stats | None
    itl_s: Stats | None
    latency_s: Stats | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    hit_rate: float | None  # None when the server reported no cached tokens
    tier_hit_rate: dict[str, float] | None  # None when it reported no tiers
    ttft_at_end: int = 0  # requests whose output showed only at the end (TTFT = latency)

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> GroupSummary:
        ok = [r for r in records if r.ok]
        with_cache = [r for r in ok if r.cached_tokens is not None]
        with_tiers = [r for r in ok if r.cached_by_tier is not None]
        hit_rate = _ratio(
            sum(r.cached_tokens or 0 for r in with_cache), sum(r.prompt_tokens for r in with_cache)
        ) if with_cache else None
        tier_hit_rate: dict[str, float] | None = None
        if with_tiers:
            prompt = sum(r.prompt_tokens for r in with_tiers)
            tier_hit_rate = {
                tier: _ratio(sum((r.cached_by_tier or {}).get(tier, 0) for r in with_tiers), prompt)
                for tier in TIERS
            }
        return cls(
            requests=len(records),
            failed=len(records) - len(ok),
            ttft_s=Stats.of(r.ttft_s for r in ok if r.ttft_s is not None),
            itl_s=Stats.of(gap for r in ok for gap in r.itl_s),
            latency_s=Stats.of(r.latency_s for r in ok),
            prompt_tokens=sum(r.prompt_tokens for r in ok),
            output_tokens=sum(r.output_tokens for r in ok),
            cached_tokens=sum(r.cached_tokens or 0 for r in with_cache),
            hit_rate=hit_rate,
            tier_hit_rate=tier_hit_rate,
            ttft_at_end=sum(1 for r in ok if not r.ttft_from_content),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupSummary:
        values = dict(data)
        for key in ("ttft_s", "itl_s", "latency_s"):
            values[key] = Stats(**values[key]) if values.get(key) is not None else None
        return cls(**values)


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


@dataclass(frozen=True)
class RunSummary:
    label: str
    duration_s: float  # first send to last response end
    input_throughput: float  # prompt tokens / s (cached ones included: what clients got served)
    prefill_throughput: float  # prompt tokens the server had to compute (not cached) / s
    output_throughput: float  # output tokens / s
    request_throughput: float  # successful requests / s
    overall: GroupSummary
    rounds: list[GroupSummary]
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, label: str, records: Sequence[RequestRecord], config: dict[str, Any] | None = None
    ) -> RunSummary:
        overall = GroupSummary.of(records)
        if records:
            duration = max(r.ended_s for r in records) - min(r.sent_s for r in records)
        else:
            duration = 0.0
        num_rounds = max((r.round for r in records), default=-1) + 1
        rounds = [GroupSummary.of([r for r in records if r.round == n]) for n in range(num_rounds)]
        ok = overall.requests - overall.failed
        return cls(
            label=label,
            duration_s=duration,
            input_throughput=_ratio(overall.prompt_tokens, duration),
            prefill_throughput=_ratio(overall.prompt_tokens - overall.cached_tokens, duration),
            output_throughput=_ratio(overall.output_tokens, duration),
            request_throughput=_ratio(ok, duration),
            overall=overall,
            rounds=rounds,
            config=dict(config or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        values = dict(data)
        values["overall"] = GroupSummary.from_json(values["overall"])
        values["rounds"] = [GroupSummary.from_json(r) for r in values["rounds"]]
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> RunSummary:
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


# ------------------------------------------------------------------------ formatting
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; columns padded so it also reads as plain text."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    separator = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(cells[0]), separator, *(line(r) for r in cells[1:])])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _ms(stats: Stats | None, attr: str) -> float | None:
    return None if stats is None else getattr(stats, attr) * 1000


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _tier_pct(group: GroupSummary, tier: str) -> str | None:
    return None if group.tier_hit_rate is None else _pct(group.tier_hit_rate[tier])


def rounds_table(summary: RunSummary) -> str:
    headers = [
        "round", "requests", "failed", "TTFT mean ms", "TTFT p90 ms", "E2E mean s",
        "hit rate", "device", "host", "storage",
    ]
    rows = [
        [
            n, g.requests, g.failed, _ms(g.ttft_s, "mean"), _ms(g.ttft_s, "p90"),
            None if g.latency_s is None else g.latency_s.mean, _pct(g.hit_rate),
            _tier_pct(g, "device"), _tier_pct(g, "host"), _tier_pct(g, "storage"),
        ]
        for n, g in enumerate(summary.rounds)
    ]
    return markdown_table(headers, rows)


def format_summary(summary: RunSummary) -> str:
    """A human-readable report of one run."""
    g = summary.overall
    lines = [
        f"## {summary.label}",
        "",
        f"requests: {g.requests} ({g.failed} failed) in {summary.duration_s:.2f} s",
        f"input throughput:   {summary.input_throughput:,.0f} tok/s "
        f"(computed: {summary.prefill_throughput:,.0f} tok/s)",
        f"output throughput:  {summary.output_throughput:,.1f} tok/s",
        f"request throughput: {summary.request_throughput:.3f} req/s",
        f"cache hit rate:     {_pct(g.hit_rate) or 'not reported'}",
    ]
    if g.tier_hit_rate is not None:
        tiers = ", ".join(f"{t} {_pct(g.tier_hit_rate[t])}" for t in TIERS)
        lines.append(f"  by tier:          {tiers}")
    if g.ttft_at_end:
        lines.append(
            f"note: {g.ttft_at_end} requests streamed no visible output before their end; "
            "their TTFT is their end-to-end latency"
        )
    lines += ["", markdown_table(
        ["metric", "mean", "p50", "p90", "p99", "max"],
        [
            [name, *(None if s is None else getattr(s, a) * 1000 for a in _STAT_FIELDS)]
            for name, s in (
                ("TTFT ms", g.ttft_s), ("ITL ms", g.itl_s), ("E2E latency ms", g.latency_s)
            )
        ],
    ), "", rounds_table(summary)]
    return "\n".join(lines)


_STAT_FIELDS = ("mean", "p50", "p90", "p99", "max")


def comparison_table(summaries: Sequence[RunSummary]) -> str:
    """One row per run; the ratios compare each run with the first (the baseline)."""
    if not summaries:
        return "(no runs)"
    base = summaries[0]
    base_ttft = base.overall.ttft_s.mean if base.overall.ttft_s is not None else None
    headers = [
        "config", "requests", "failed", "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms",
        "TTFT p99 ms", "ITL mean ms", "E2E mean s", "input tok/s", "output tok/s", "req/s",
        "hit rate", "device", "host", "storage", f"input tok/s vs {base.label}",
        f"TTFT vs {base.label}",
    ]
    rows = []
    for s in summaries:
        g = s.overall
        ttft = g.ttft_s.mean if g.ttft_s is not None else None
        rows.append([
            s.label, g.requests, g.failed, _ms(g.ttft_s, "mean"), _ms(g.ttft_s, "p50"),
            _ms(g.ttft_s, "p90"), _ms(g.ttft_s, "p99"), _ms(g.itl_s, "mean"),
            None if g.latency_s is None else g.latency_s.mean, s.input_throughput,
            s.output_throughput, s.request_throughput, _pct(g.hit_rate),
            _tier_pct(g, "device"), _tier_pct(g, "host"), _tier_pct(g, "storage"),
            f"{s.input_throughput / base.input_throughput:.2f}x"
            if base.input_throughput > 0 else None,
            f"{100 * (ttft / base_ttft - 1):+.1f}%"
            if ttft is not None and base_ttft else None,
        ])
    return markdown_table(headers, rows)
