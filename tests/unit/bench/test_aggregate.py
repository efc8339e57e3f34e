"""Aggregates over repeated runs and the hicache / baseline ratios, on hand-made records."""

from __future__ import annotations

import pytest

from hicache.bench.aggregate import (
    Aggregate,
    RunResult,
    aggregates,
    aggregates_table,
    ratios,
    ratios_table,
    runs_table,
    total_throughput,
    workload_mismatches,
)
from hicache.bench.report import RequestRecord, RunSummary


def record(sent: float, latency: float, ttft: float, prompt: int, output: int,
           ok: bool = True) -> RequestRecord:
    return RequestRecord(
        session=0, round=0, group=0, sent_s=sent, ok=ok, latency_s=latency, ttft_s=ttft,
        ttft_from_content=True, itl_s=[], prompt_tokens=prompt, output_tokens=output,
        cached_tokens=None, cached_by_tier=None, error=None if ok else "boom",
    )


def result(name: str, repeat: int, records: list[RequestRecord]) -> RunResult:
    summary = RunSummary.of(f"{name}.{repeat}", records)
    return RunResult(name, repeat, summary, records, (1.0, 0.5, 0.25), (1.5, 0.6, 0.3))


# hicache: run 1 lasts 2 s (100 + 20 tokens out), run 2 lasts 4 s (100 + 20 out).
HI = [
    result("l1", 1, [record(0, 1, 0.1, 100, 10), record(1, 1, 0.3, 100, 10)]),
    result("l1", 2, [record(0, 4, 0.2, 100, 10), record(0, 2, 0.4, 100, 10)]),
]
# baseline: run 1 lasts 4 s, run 2 lasts 8 s, same tokens; one failed request is left out.
BASE = [
    result("vllm", 1, [record(0, 4, 0.8, 100, 10), record(0, 3, 1.2, 100, 10),
                       record(0, 1, 9.0, 100, 0, ok=False)]),
    result("vllm", 2, [record(0, 8, 1.0, 100, 10), record(1, 7, 1.4, 100, 10)]),
]


def test_aggregate_pools_tokens_over_summed_durations_and_ttft_over_requests() -> None:
    agg = Aggregate.of("l1", HI)
    assert agg.runs == 2 and agg.requests == 4 and agg.failed == 0
    assert agg.duration_s == pytest.approx(6.0)
    assert agg.output_throughput == pytest.approx(40 / 6)
    assert agg.total_throughput == pytest.approx(440 / 6)
    assert agg.ttft_s is not None and agg.ttft_s.mean == pytest.approx(0.25)
    assert agg.ttft_s.p50 == pytest.approx(0.25)
    assert agg.output_throughput_runs == pytest.approx((10.0, 5.0))
    base = Aggregate.of("vllm", BASE)
    assert base.failed == 1 and base.requests == 5
    assert base.output_throughput == pytest.approx(40 / 12)
    assert base.ttft_s is not None and base.ttft_s.count == 4  # the failure is not timed


def test_ratios_divide_the_aggregates_and_pair_runs_by_repeat() -> None:
    runs = [HI[0], BASE[0], HI[1], BASE[1]]
    assert [a.name for a in aggregates(runs)] == ["l1", "vllm"]
    [r] = ratios(runs, "vllm", ["l1"])
    assert r.output_throughput == pytest.approx((40 / 6) / (40 / 12))
    assert r.total_throughput == pytest.approx(2.0)
    assert r.ttft_mean == pytest.approx(0.25 / 1.1)
    # Run i of hicache over run i of the baseline: 10/5 and 5/2.5.
    assert r.output_throughput_per_repeat == pytest.approx((2.0, 2.0))
    assert ratios(runs, "missing", ["l1"]) == []
    assert ratios(HI, "vllm", ["l1"]) == []


def test_tables_show_every_run_with_its_load() -> None:
    runs = [HI[0], BASE[0], HI[1], BASE[1]]
    table = runs_table(runs)
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert "l1.1" in lines[2] and "vllm.1" in lines[3] and "1.00 0.50 0.25" in lines[2]
    assert "1.50 0.60 0.30" in lines[2]
    assert total_throughput(HI[0].summary) == pytest.approx(220 / 2)
    assert "| l1 " in aggregates_table(aggregates(runs))
    assert "2.00x, 2.00x" in ratios_table(ratios(runs, "vllm", ["l1"]))


def test_a_workload_that_differs_between_the_sides_is_flagged() -> None:
    runs = [HI[0], BASE[0], HI[1], BASE[1]]
    assert workload_mismatches(aggregates(runs), "vllm") == []  # failures: no comparison
    longer = [
        result("vllm", 1, [record(0, 4, 0.8, 150, 10), record(0, 3, 1.2, 100, 10)]),
        result("vllm", 2, [record(0, 8, 1.0, 150, 10), record(1, 7, 1.4, 100, 10)]),
    ]
    [warning] = workload_mismatches(aggregates([*HI, *longer]), "vllm")
    assert "l1 got 200 prompt tokens a run, vllm 250" in warning
    assert workload_mismatches(aggregates([*HI, *BASE[1:]]), "vllm") == []
