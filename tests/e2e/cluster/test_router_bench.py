"""``hicache bench router``: its report arithmetic, its flag checks, and a smoke run.

The smoke run drives real tiny-model workers behind a real router: ``hicache router``
where it is a command, else SGLang's router (same flags) where that is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hicache.bench import router_bench, router_report
from hicache.bench.cluster import router_available
from hicache.bench.report import RequestRecord, Stats
from hicache.bench.router_report import PolicyResult, Target, targets, tier_share
from hicache.cli import build_parser, main


def bench_args(*argv: str) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(["bench", "router", *argv])
    router_bench.resolve_sizes(args)
    return args


def record(prompt: int, cached: int, by_tier: dict[str, int], ok: bool = True) -> RequestRecord:
    return RequestRecord(
        session=0, round=0, group=0, sent_s=0.0, ok=ok, latency_s=1.0, ttft_s=0.1,
        ttft_from_content=True, itl_s=[], prompt_tokens=prompt, output_tokens=4,
        cached_tokens=cached, cached_by_tier=by_tier,
    )


def result(policy: str, throughput: float, ttft_mean_s: float) -> PolicyResult:
    stats = Stats(1, ttft_mean_s, ttft_mean_s, ttft_mean_s, ttft_mean_s, ttft_mean_s)
    return PolicyResult(policy, 1, 10, 0, throughput, throughput / 10, stats, {}, [])


def test_tier_shares_are_of_the_successful_requests_prompt_tokens() -> None:
    records = [
        record(100, 60, {"device": 30, "host": 20, "storage": 10}),
        record(300, 100, {"device": 0, "host": 0, "storage": 100}),
        record(1000, 1000, {"device": 1000, "host": 0, "storage": 0}, ok=False),
    ]
    share = tier_share(records)
    assert share == pytest.approx(
        {"device": 30 / 400, "host": 20 / 400, "storage": 110 / 400, "recomputed": 240 / 400}
    )
    assert tier_share([]) == {"device": 0.0, "host": 0.0, "storage": 0.0, "recomputed": 0.0}


def test_targets_compare_tier_aware_with_round_robin_and_cache_aware() -> None:
    met = targets([result("round_robin", 100.0, 1.0), result("cache_aware", 120.0, 0.8),
                   result("tier_aware", 140.0, 0.5)])
    assert [t.met for t in met] == [True, True]
    assert met[0].value == pytest.approx(1.4) and met[1].value == pytest.approx(1 - 0.5 / 0.8)
    short = targets([result("round_robin", 100.0, 1.0), result("cache_aware", 120.0, 0.6),
                     result("tier_aware", 120.0, 0.5)])
    assert [t.met for t in short] == [False, False]
    alone = targets([result("tier_aware", 140.0, 0.5)])
    assert alone == [Target(alone[0].description, None, None),
                     Target(alone[1].description, None, None)]
    assert "not measured" in router_report.targets_table(alone)


def test_bad_flags_fail_before_any_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    program = ["--router-program", "true"]
    for flags, message in (
        (["--repeats", "0", *program], "--repeats must be >= 1"),
        (["--num-workers", "0", *program], "--num-workers must be >= 1"),
        (["--hicache-ratio", "1", *program], "--hicache-ratio must be > 1"),
        (["--l3-extra-config", "[1]", *program], "must be a JSON object"),
        (["--l3-extra-config", "{", *program], "is not JSON"),
    ):
        assert main(["bench", "router", "--out-dir", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.setattr(router_bench, "router_available", lambda: False)
    assert main(["bench", "router", "--out-dir", str(out)]) == 2
    assert "give --router-program" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "router", "--out-dir", "x", "--policies", "random"])


def test_sizes_default_to_a_working_set_beyond_one_workers_pools() -> None:
    args = bench_args("--out-dir", "x", "--router-program", "true")
    plan = router_bench.make_plan(args)
    l1, l2 = args.max_total_tokens, args.max_total_tokens * args.hicache_ratio
    assert plan.working_set_tokens > l1 + l2
    assert not any(note.startswith("WARNING") for note in plan.notes)
    smoke = router_bench.make_plan(bench_args("--out-dir", "x", "--smoke", "--max-total-tokens",
                                              "4096", "--router-program", "true"))
    assert "--model-preset" in smoke.worker_args and smoke.l3_extra["prefetch_threshold"] == 16
    assert any(note.startswith("WARNING") for note in smoke.notes)  # 4096 holds it all


def _router_choice() -> tuple[list[str], list[str]] | None:
    """Policies and extra flags of the router the smoke run can use, or None."""
    if router_available():
        return ["round_robin", "tier_aware"], []
    if importlib.util.find_spec("sglang_router") is not None:
        program = f"{sys.executable} -m sglang_router.launch_router"
        return ["round_robin", "cache_aware"], ["--router-program", program]
    return None


def test_smoke_run_through_the_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = _router_choice()
    # `hicache router` is part of hicache: a run without a router is broken, not skipped.
    assert choice is not None, (
        "no router: `hicache router` is not a command and sglang_router is not installed")
    policies, extra = choice
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # SGLang's router must not look for a tokenizer
    out = tmp_path / "out"
    code = main(["bench", "router", "--smoke", "--out-dir", str(out), "--num-workers", "2",
                 "--startup-timeout", "180", "--policies", *policies, *extra])
    report = (out / "router_bench.md").read_text()
    assert code == 0, report
    data = json.loads((out / "router_bench.json").read_text())
    assert [p["policy"] for p in data["policies"]] == policies
    for policy in data["policies"]:
        assert policy["requests"] == 6 * 3 and policy["failed"] == 0
        # Every workload request (and the warm-up) reached a worker, and some were cached.
        assert sum(policy["worker_requests"]) == 6 * 3 + 1
        assert policy["tier_share"]["recomputed"] < 1.0
    for run in data["runs"]:
        # Every later turn (6 conversations x 2) was found in exactly one worker's log, by
        # the id the client gave it.
        placed = run["placement"]
        assert placed["placed"] == 6 * 2 and 0 <= placed["kept"] <= 6 * 2, run
        # tier_aware predicted every streamed request's TTFT and measured it; a policy that
        # predicts nothing (and another router) has nothing to check.
        prediction = run["prediction"]
        if run["policy"] == "tier_aware":
            assert prediction["decisions"] >= 6 * 3 and prediction["median_ratio"] > 0, run
        else:
            assert prediction is None, run
    for policy in policies:
        assert (out / f"{policy}.json").is_file() and (out / f"{policy}.jsonl").is_file()
        run_dir = out / "runs" / policy
        assert (run_dir / "worker-0.log").is_file() and (run_dir / "router.log").is_file()
        for k in range(2):  # each worker's counters at the end: what its L3 reads found
            metrics = (run_dir / f"worker-{k}-metrics.txt").read_text()
            assert "hicache_requests_total" in metrics
        assert not (run_dir / "l3").exists()  # the run's L3 pages are removed after it
        if not extra:  # our router: its decisions are kept, each worker's score in each
            saved = json.loads((run_dir / "router-decisions.json").read_text())["decisions"]
            assert len(saved) >= 6 * 3
            if policy == "tier_aware":
                assert all(len(d["logits"]) == len(d["overlaps"]) == 2 for d in saved)
    assert "## Targets" in report and "## Runs in order" in report
    assert "## How well the router predicted TTFT" in report


def test_the_shared_l3_queries_outcomes_become_a_note_of_the_run() -> None:
    metrics = "\n".join([
        "# HELP router_shared_cache_queries_total how the queries ended",
        "# TYPE router_shared_cache_queries_total counter",
        'router_shared_cache_queries_total{outcome="answered"} 341.0',
        'router_shared_cache_queries_total{outcome="late"} 44.0',
        "",
    ])
    assert router_bench._shared_query_notes(metrics) == [
        "shared-L3 queries: 88.6% answered in time (341 answered, 44 late, 0 failed)"]
    # No tier_aware query (another policy, or a router without the counter): no note.
    assert router_bench._shared_query_notes("# nothing\n") == []
