"""``hicache bench router --sweep``: the grid, the sizes per point, the resume logic, and the
main loop with the runs stubbed out (no process starts)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache.bench import router_sweep
from hicache.bench.multiturn import multiturn_workload, prompt_maker
from hicache.bench.router_bench import RouterBenchError, resolve_sizes
from hicache.bench.router_sweep import (
    PROMPT_CLASSES,
    SweepPoint,
    expand_grid,
    parse_axis,
    parse_ws,
    point_deadline,
    point_sizes,
    run_order,
    settings_of,
)
from hicache.bench.router_sweep_report import (
    Contender,
    ContenderStats,
    PointResult,
    SweepState,
)
from hicache.bench.sweep_load import LoadSpec, poisson_schedule
from hicache.cli import build_parser, main


def sweep_args(out: Path, *argv: str) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(
        ["bench", "router", "--sweep", "--out-dir", str(out), *argv])
    resolve_sizes(args)
    return args


def test_the_full_grid_is_72_points_and_each_axis_narrows_it() -> None:
    grid = expand_grid(router_sweep.WS_RATIOS, router_sweep.L3_MODES, router_sweep.ARRIVALS,
                       router_sweep.PROMPTS)
    assert len(grid) == len(set(grid)) == 4 * 3 * 3 * 2
    assert {p.id for p in grid} >= {"short-ws0.5-l3none-closed", "long-ws4-l3all-poisson90"}
    # Every open-loop point comes after the closed-loop point that measures its capacity.
    ids = [p.id for p in grid]
    for index, point in enumerate(grid):
        if point.load_fraction is not None:
            assert ids.index(point.capacity_point().id) < index
    narrow = expand_grid([2.0], ["all"], ["closed"], ["short"])
    assert narrow == [SweepPoint("short", 2.0, "all", "closed")]


def test_an_open_loop_point_alone_brings_its_closed_loop_point_first() -> None:
    points = expand_grid([1.0], ["small"], ["poisson90", "poisson50"], ["long"])
    assert [p.arrival for p in points] == ["closed", "poisson90", "poisson50"]
    assert points[1].load_fraction == 0.9 and points[2].load_fraction == 0.5
    assert points[0].load_fraction is None


def test_axis_flags_are_checked() -> None:
    assert parse_axis("none, all,none", router_sweep.L3_MODES, "--sweep-l3") == ["none", "all"]
    assert parse_ws("0.5,4") == [0.5, 4.0]
    for text in ("", "huge", "none,huge"):
        with pytest.raises(RouterBenchError, match="--sweep-l3"):
            parse_axis(text, router_sweep.L3_MODES, "--sweep-l3")
    for text in ("", "a", "0", "-1", "inf"):
        with pytest.raises(RouterBenchError, match="--sweep-ws"):
            parse_ws(text)


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_sizes_make_the_working_set_the_points_multiple_of_the_cluster_pools(prompt: str) -> None:
    conversation = PROMPT_CLASSES[prompt].conversation_tokens
    pools = set()
    for ws in (0.5, 1.0, 2.0, 4.0):
        sizes = point_sizes(SweepPoint(prompt, ws, "all", "closed"), 3, 2.0, 1000)
        # L1 holds the longest conversation with room to spare, in whole 256-token blocks.
        assert sizes.l1_tokens % 256 == 0 and sizes.l1_tokens >= 1.5 * conversation
        assert sizes.l2_tokens == 2 * sizes.l1_tokens
        cluster = 3 * sizes.worker_tokens
        assert sizes.working_set_tokens == sizes.num_clients * conversation
        # Within half a conversation of the asked multiple.
        assert abs(sizes.working_set_tokens - ws * cluster) <= conversation / 2
        assert sizes.l3_max_bytes is None and sizes.max_inflight == 6
        pools.add((sizes.l1_tokens, sizes.l2_tokens))
    assert len(pools) == 1  # one prompt class, one worker size: points are comparable
    small = point_sizes(SweepPoint(prompt, 2.0, "small", "closed"), 3, 2.0, 1000)
    assert small.l3_max_bytes == small.working_set_tokens * 1000 // 2
    assert point_sizes(SweepPoint(prompt, 2.0, "none", "closed"), 3, 2.0, 1000).l3_max_bytes \
        is None


def test_long_prompts_are_2k_and_more_short_ones_256() -> None:
    assert PROMPT_CLASSES["short"].request_length == 256
    assert PROMPT_CLASSES["long"].request_length >= 2048


def test_repeats_alternate_the_order() -> None:
    names = ["hicache-tier_aware", "sglang"]
    assert run_order(names, 1) == names and run_order(names, 2) == names[::-1]
    assert run_order(names, 3) == names


def _stats(name: str, kind: str, throughput: float) -> ContenderStats:
    return ContenderStats(name, kind, 1, 10, 0, throughput, 1.0, 2.0, 5.0, {"device": 0.5})


def _result(point: SweepPoint, errors: list[str] | None = None,
            capacity: float | None = 5.0) -> PointResult:
    sizes = point_sizes(point, 3, 2.0, 1000).to_json()
    return PointResult(point.id, router_sweep.point_fields(point), sizes, None, capacity,
                       [_stats("hicache-tier_aware", "hicache", 120.0),
                        _stats("sglang", "sglang", 100.0)], errors or [])


def test_state_round_trips_and_counts_only_clean_points_as_done(tmp_path: Path) -> None:
    path = tmp_path / "router_sweep.json"
    settings = {"num_workers": 3, "seed": 0}
    state = SweepState.load(path, settings)
    closed = SweepPoint("short", 2.0, "all", "closed")
    broken = SweepPoint("short", 4.0, "all", "closed")
    state.record(_result(closed))
    state.record(_result(broken, errors=["sglang: 2 requests failed"]))
    state.save()
    again = SweepState.load(path, settings)
    assert again.done(closed.id) and not again.done(broken.id)
    assert not again.done("short-ws1-l3all-closed")
    restored = again.result(closed.id)
    assert restored is not None and restored.contenders == _result(closed).contenders
    with pytest.raises(ValueError, match="num_workers"):
        SweepState.load(path, {"num_workers": 2, "seed": 0})


def test_main_resumes_and_gives_open_points_their_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, float | None, list[str]]] = []

    def fake_run_point(point: SweepPoint, args: Any, settings: Any, out_dir: Path,
                       capacity: float | None, todo: Sequence[Contender],
                       previous: PointResult | None) -> PointResult:
        calls.append((point.id, capacity, [c.name for c in todo]))
        sizes = point_sizes(point, 3, 2.0, 1000).to_json()
        rate = None if point.load_fraction is None else point.load_fraction * (capacity or 0)
        result = PointResult.of(point.id, router_sweep.point_fields(point), sizes, rate,
                                capacity, [], todo, previous)
        if rate is None:
            result.capacity_rps = 7.5  # what SGLang's closed-loop run would have measured
        return result

    monkeypatch.setattr(router_sweep, "run_point", fake_run_point)
    monkeypatch.setattr(router_sweep, "default_router_policy", lambda: "tier_aware")
    out = tmp_path / "out"
    both = ["hicache-tier_aware", "sglang"]
    flags = ["--sweep-ws", "2", "--sweep-l3", "all", "--sweep-prompt", "short",
             "--sweep-arrival", "closed,poisson50"]
    assert router_sweep.main(sweep_args(out, *flags)) == 0
    assert calls == [("short-ws2-l3all-closed", None, both),
                     ("short-ws2-l3all-poisson50", 7.5, both)]
    data = json.loads((out / "router_sweep.json").read_text())
    assert set(data["points"]) == {"short-ws2-l3all-closed", "short-ws2-l3all-poisson50"}
    assert "short-ws2-l3all-poisson50" in (out / "router_sweep.md").read_text()
    assert (out / "router_sweep.png").stat().st_size > 0
    # A second session with one more point runs that one only, from the stored capacity.
    calls.clear()
    flags[-1] = "closed,poisson50,poisson90"
    assert router_sweep.main(sweep_args(out, *flags)) == 0
    assert calls == [("short-ws2-l3all-poisson90", 7.5, both)]
    # Other cluster settings do not mix into this state.
    assert router_sweep.main(sweep_args(out, *flags, "--num-workers", "2")) == 2
    assert len(calls) == 1
    # Another SGLang setting runs alone at every done point; the others' results stay.
    calls.clear()
    tuned = ["--sglang-args", "--cache-threshold 0.3"]
    assert router_sweep.main(sweep_args(out, *flags, *tuned)) == 0
    assert [c[2] for c in calls] == [["sglang-tuned"]] * 3
    point = json.loads((out / "router_sweep.json").read_text())["points"][
        "short-ws2-l3all-closed"]
    assert [c["name"] for c in point["contenders"]] == [*both, "sglang-tuned"]
    # Changed flags for our router: it runs again, under the same name, and replaces its result.
    calls.clear()
    assert router_sweep.main(sweep_args(out, *flags, *tuned, "--router-args",
                                        "--overlap-weight 2")) == 0
    assert [c[2] for c in calls] == [["hicache-tier_aware"]] * 3
    point = json.loads((out / "router_sweep.json").read_text())["points"][
        "short-ws2-l3all-closed"]
    ours = [c for c in point["contenders"] if c["kind"] == "hicache"]
    assert len(ours) == 1 and ours[0]["setting"]["args"] == "--overlap-weight 2"
    # A different run length is not another setting: nothing runs.
    calls.clear()
    assert router_sweep.main(sweep_args(out, *flags, *tuned, "--router-args",
                                        "--overlap-weight 2", "--sweep-point-seconds", "90")) == 0
    assert calls == []


def test_a_given_capacity_runs_the_open_loop_points_alone_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, float | None]] = []

    def fake_run_point(point: SweepPoint, args: Any, settings: Any, out_dir: Path,
                       capacity: float | None, todo: Sequence[Contender],
                       previous: PointResult | None) -> PointResult:
        calls.append((point.id, capacity))
        sizes = point_sizes(point, 3, 2.0, 1000).to_json()
        rate = None if capacity is None else (point.load_fraction or 0) * capacity
        return PointResult.of(point.id, router_sweep.point_fields(point), sizes, rate,
                              capacity, [], todo, previous)

    monkeypatch.setattr(router_sweep, "run_point", fake_run_point)
    flags = ["--sweep-ws", "1", "--sweep-l3", "none", "--sweep-prompt", "long",
             "--sweep-arrival", "poisson90", "--sweep-capacity", "0.29"]
    assert router_sweep.main(sweep_args(tmp_path / "out", *flags)) == 0
    assert calls == [("long-ws1-l3none-poisson90", 0.29)]
    assert expand_grid([1.0], ["none"], ["poisson90"], ["long"], capacity_given=True) == [
        SweepPoint("long", 1.0, "none", "poisson90")]


def test_an_open_loop_run_lasts_until_every_turn_has_arrived(tmp_path: Path) -> None:
    settings = settings_of(sweep_args(tmp_path, "--sweep-point-seconds", "40"))
    assert settings.open_max_seconds == 300.0
    point = SweepPoint("short", 4.0, "all", "poisson50")
    sizes = point_sizes(point, 2, 2.0, 46080)
    # Closed loop: the flag's length.
    assert point_deadline(sizes, None, settings) == 40.0
    # At 1.1 requests a second, 38 conversations x 4 turns take about 140 s to arrive: the
    # run sends every one of them (40 s would have sent about one turn per conversation).
    assert (sizes.num_clients, sizes.prompt.num_rounds) == (38, 4)
    deadline = point_deadline(sizes, 1.1, settings)
    schedule = poisson_schedule(sizes.num_clients, sizes.prompt.num_rounds, 1.1, settings.seed)
    last = max(max(turns) for turns in schedule)
    assert 100.0 < last < deadline <= last + 2.0
    sent_by_40s = sum(t <= 40.0 for turns in schedule for t in turns)
    assert sent_by_40s < 1.5 * sizes.num_clients
    # A fast schedule is never cut shorter than the closed loop's run ...
    assert point_deadline(sizes, 100.0, settings) == 40.0
    # ... and a slow one stops at the cap.
    capped = settings_of(sweep_args(tmp_path, "--sweep-open-max-seconds", "120"))
    assert point_deadline(sizes, 1.1, capped) == 120.0


def test_a_point_with_a_failed_run_runs_every_contender_again() -> None:
    point = SweepPoint("short", 2.0, "all", "closed")
    mine = Contender("hicache-tier_aware", "hicache", "tier_aware", "", None)
    theirs = Contender("sglang", "sglang", "cache_aware", "", "sglang-router")
    result = PointResult.of(point.id, router_sweep.point_fields(point), {}, None, None, [],
                            [mine, theirs])
    assert result.missing([mine, theirs]) == []
    result.errors.append("sglang: 2 requests failed")
    assert result.missing([mine, theirs]) == [mine, theirs]


def test_ours_run_again_once_the_routers_defaults_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = sweep_args(tmp_path)
    args.sglang_program = router_sweep.SGLANG_PROGRAM
    before = router_sweep.contenders(args)
    assert "--overlap-weight" in before[0].defaults  # what the router's flags default to
    point = SweepPoint("short", 1.0, "none", "closed")
    result = PointResult.of(point.id, router_sweep.point_fields(point), {}, None, None, [],
                            list(before))
    assert result.missing(before) == []
    monkeypatch.setattr(router_sweep, "router_defaults", lambda: "--overlap-weight 9")
    after = router_sweep.contenders(args)
    # Ours (same names, same flags) now run under other defaults; SGLang's result stands.
    assert [c.name for c in result.missing(after)] == [
        c.name for c in after if c.kind == "hicache"]


def test_bad_sweep_flags_fail_before_any_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    for flags, message in (
        (["--sweep-ws", "0"], "--sweep-ws"),
        (["--sweep-arrival", "poisson"], "--sweep-arrival"),
        (["--sweep-prompt", "medium"], "--sweep-prompt"),
        (["--sweep-point-seconds", "0"], "--sweep-point-seconds"),
        (["--sweep-open-max-seconds", "30"], "--sweep-open-max-seconds"),
        (["--repeats", "0"], "--repeats"),
        (["--sweep-capacity", "0"], "--sweep-capacity"),
    ):
        assert main(["bench", "router", "--sweep", "--out-dir", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_contenders_are_the_default_policy_the_asked_ones_and_sglang(tmp_path: Path) -> None:
    args = sweep_args(tmp_path, "--policies", "round_robin", "--sglang-args",
                      "--cache-threshold 0.3")
    assert args.sglang_args == ["--cache-threshold 0.3"]
    args.sglang_program = router_sweep.SGLANG_PROGRAM
    names = [c.name for c in router_sweep.contenders(args)]
    default = router_sweep.default_router_policy()
    assert names[0] == f"hicache-{default}"
    assert names[-2:] == ["sglang", "sglang-tuned"] and "hicache-round_robin" in names
    tuned = router_sweep.contenders(args)[-1]
    assert tuned.args == "--cache-threshold 0.3" and tuned.policy == "cache_aware"
    two = sweep_args(tmp_path, "--sglang-args", "--cache-threshold 0.3", "--sglang-args",
                     "--balance-abs-threshold 16")
    assert [c.name for c in router_sweep.contenders(two)][-3:] == [
        "sglang", "sglang-tuned-1", "sglang-tuned-2"]


def test_a_variant_is_the_default_policy_with_its_flags_added(tmp_path: Path) -> None:
    args = sweep_args(tmp_path, "--router-args", "--overlap-weight 2", "--variant-args",
                      "--conversation-affinity off")
    args.sglang_program = router_sweep.SGLANG_PROGRAM
    default = router_sweep.default_router_policy()
    ours = [c for c in router_sweep.contenders(args) if c.kind == "hicache"]
    assert [(c.name, c.policy, c.args) for c in ours] == [
        (f"hicache-{default}", default, "--overlap-weight 2"),
        (f"hicache-{default}-variant", default,
         "--overlap-weight 2 --conversation-affinity off"),
    ]


def test_the_bench_knows_every_router_policy() -> None:
    from hicache.bench.router_bench import POLICIES
    from hicache.router.policy import PolicyName

    assert set(POLICIES) == {policy.value for policy in PolicyName}


def test_the_report_warns_when_workers_outnumber_the_cores() -> None:
    assert router_sweep.shared_cores_note(2, 2) is None
    note = router_sweep.shared_cores_note(3, 2)
    assert note is not None and "3 workers share 2 CPU cores" in note


def test_generations_lengthen_a_run_at_the_same_working_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = settings_of(sweep_args(tmp_path))
    assert plain.generations == 1 and "generations" not in plain.to_json()
    settings = settings_of(sweep_args(tmp_path, "--sweep-generations", "3"))
    assert settings.to_json()["generations"] == 3
    with pytest.raises(RouterBenchError, match="generations"):
        settings_of(sweep_args(tmp_path, "--sweep-generations", "0"))
    # An open loop waits for every generation's turns to arrive.
    point = SweepPoint("short", 1.0, "none", "poisson50")
    sizes = point_sizes(point, 2, 2.0, 46080)
    span = max(max(t) for t in poisson_schedule(sizes.num_clients, 3 * 4, 0.5, settings.seed))
    assert point_deadline(sizes, 0.5, settings) == min(300.0, float(int(span) + 2))
    assert point_deadline(sizes, 0.5, settings) > point_deadline(sizes, 0.5, plain)
    # The runner plays the point's conversations, then as many fresh ones twice more, with
    # the point's conversations alive at once.
    seen: dict[str, Any] = {}

    async def fake_run_load(url: str, sessions: Sequence[Any], maker: Any, spec: Any,
                            label: str, **kwargs: Any) -> str:
        seen.update(sessions=sessions, spec=spec)
        return "summary"

    monkeypatch.setattr(router_sweep, "run_load", fake_run_load)
    args = sweep_args(tmp_path, "--sweep-generations", "3")
    contender = router_sweep.contenders(args)[0]
    run_args = router_sweep._point_args(args, sizes, point, contender)
    maker = prompt_maker(run_args)
    first = multiturn_workload(run_args, maker)
    spec = LoadSpec(deadline_s=10.0, max_inflight=4, live=len(first))
    runner = router_sweep._runner(spec, args, settings.generations)
    assert asyncio.run(runner(run_args, first, maker, "http://x", "l", {})) == "summary"
    chained = seen["sessions"]
    assert len(chained) == 3 * len(first) and seen["spec"].live == len(first)
    assert [s.parts for s in chained[:len(first)]] == [s.parts for s in first]
    assert len({str(s.parts[0]) for s in chained}) == len(chained)  # fresh text each
