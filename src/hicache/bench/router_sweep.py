"""``hicache bench router --sweep``: hicache's router against SGLang's over a grid of workloads.

The grid (issue 34), each axis narrowable by its flag:

- ``--sweep-ws``: the working set (every conversation's whole context) over the cluster's
  L1 + L2 (all workers' device and host pools): 0.5, 1, 2, 4;
- ``--sweep-l3``: the shared file L3: ``none``; ``small`` (capped at ``SMALL_L3_SHARE`` of
  the working set's KV bytes); ``all`` (uncapped: it holds everything);
- ``--sweep-arrival``: ``closed`` (``2 x --num-workers`` requests in flight) or open-loop
  Poisson arrivals at 50% / 90% of the point's measured capacity (``poisson50``,
  ``poisson90``): the successful requests per second of SGLang's router (its defaults) in
  the closed-loop run of the same workload, so a Poisson point runs after (or with) its
  closed one. The load models are bench/sweep_load.py's;
- ``--sweep-prompt``: ``short`` (256-token first prompt, +64 a round, 4 rounds) or ``long``
  (2,048, +128, 3 rounds); 8 output tokens.

Sizes per point: each worker's L1 holds ``L1_CONTEXTS`` of the prompt class's longest
conversation (rounded up to 256 tokens), its L2 is ``--hicache-ratio`` times that, and the
number of conversations makes the working set the point's multiple of the cluster's
L1 + L2. So points of one prompt class share their workers and differ only in how much the
conversations outgrow them. A closed-loop run stops sending after ``--sweep-point-seconds``;
an open-loop one once its schedule has sent every turn of every conversation
(``point_deadline``), within ``--sweep-open-max-seconds`` and never before
``--sweep-point-seconds``: at half of capacity a 40 s run sends about one turn per
conversation at ws 2 and 4, so it measures first turns, which no cache holds, not
routing. Each point records its run length (the long prompts may be given more time in
another session of the same sweep). ``--sweep-generations G`` makes each conversation a
chain of G (a fresh one starts when the one before has answered its last turn:
sweep_load.py): as many conversations are alive at once, so the working set stays the
point's, but a run sends up to G times the turns. On a fast host a closed loop of one
generation answers every turn in seconds, too few requests for one run to tell two
routers apart.

Each point runs, in a fresh cluster per run: ``hicache router`` with its default policy
(whatever it is at run time) and with every ``--policies`` given, and SGLang's router
(``--sglang-program``, cache_aware) at its defaults and once more with each
``--sglang-args`` given, and ours once more with each ``--variant-args`` added to its
``--router-args`` (an A/B of one router setting in the same alternation). With
``--repeats N`` every run goes N times, in reverse order on even repeats. Results
(router_sweep_report.py) go to ``--out-dir``: ``router_sweep.json`` (the state: a router
setting that ran cleanly at a point is not run there again, so a sweep can span sessions
and gain settings; another cluster setting refuses to mix into it), ``router_sweep.md``,
``router_sweep.png``, and every run's files under ``points/<point>/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hicache.bench.client import ApiStyle
from hicache.bench.cluster import L3Kind
from hicache.bench.multiturn import args_config, multiturn_workload
from hicache.bench.report import RunSummary
from hicache.bench.router_bench import (
    SMOKE_L3_EXTRA,
    Plan,
    RouterBenchError,
    make_plan,
    run_policy,
)
from hicache.bench.router_report import PolicyRun
from hicache.bench.router_sweep_report import (
    Contender,
    PointResult,
    SweepState,
    write_sweep_report,
)
from hicache.bench.sweep_load import LoadSpec, run_load, schedule_span
from hicache.bench.workload import PromptMaker, Session, WorkloadError, working_set_tokens

WS_RATIOS = (0.5, 1.0, 2.0, 4.0)
L3_MODES = ("none", "small", "all")
ARRIVALS = ("closed", "poisson50", "poisson90")
PROMPTS = ("short", "long")
LOAD_FRACTIONS = {"poisson50": 0.5, "poisson90": 0.9}

# Each worker's L1 holds this many of the longest conversations (so a worker can run
# more than one at a time); rounded up to whole multiples of L1_ROUND tokens.
L1_CONTEXTS = 1.5
L1_ROUND = 256
# The small L3 holds this share of the working set's KV.
SMALL_L3_SHARE = 0.5
# KV bytes per token of serve's default model, SmolLM2-135M in f32: 30 layers x (K, V)
# x 3 KV heads x 64 dims x 4 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
SGLANG_PROGRAM = f"{sys.executable} -m sglang_router.launch_router"
SGLANG_POLICY = "cache_aware"


@dataclass(frozen=True)
class PromptClass:
    request_length: int  # tokens of a conversation's first prompt
    sub_question_length: int  # tokens each later round adds
    output_length: int
    num_rounds: int

    @property
    def conversation_tokens(self) -> int:
        """One conversation's share of the working set (workload.working_set_tokens)."""
        return working_set_tokens(
            1, self.num_rounds, self.request_length, self.sub_question_length,
            self.output_length,
        )


PROMPT_CLASSES = {
    "short": PromptClass(256, 64, 8, 4),
    "long": PromptClass(2048, 128, 8, 3),
}


@dataclass(frozen=True)
class SweepPoint:
    prompt: str
    ws: float  # working set / the cluster's L1 + L2
    l3: str
    arrival: str

    @property
    def id(self) -> str:
        return f"{self.prompt}-ws{self.ws:g}-l3{self.l3}-{self.arrival}"

    @property
    def load_fraction(self) -> float | None:
        """Of the measured capacity, for an open-loop point; None: closed loop."""
        return LOAD_FRACTIONS.get(self.arrival)

    def capacity_point(self) -> SweepPoint:
        """The closed-loop point whose reference run measures this point's capacity."""
        return replace(self, arrival="closed")


def parse_axis(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise RouterBenchError(f"{flag}: {', '.join(bad) or 'nothing'} is not of "
                               f"{', '.join(allowed)}")
    return list(dict.fromkeys(values))


def parse_ws(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RouterBenchError(f"--sweep-ws: {text!r} is not a list of numbers") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise RouterBenchError(f"--sweep-ws: give positive numbers, not {text!r}")
    return list(dict.fromkeys(values))


def expand_grid(
    ws: Sequence[float], l3: Sequence[str], arrivals: Sequence[str], prompts: Sequence[str],
    capacity_given: bool = False,
) -> list[SweepPoint]:
    """The points in run order: by prompt class, working set, L3, then arrival; an
    open-loop point's closed-loop point (its capacity) comes first, added when not asked
    (unless ``capacity_given``: --sweep-capacity)."""
    points: list[SweepPoint] = []
    for prompt in prompts:
        for ratio in ws:
            for mode in l3:
                asked = [SweepPoint(prompt, ratio, mode, a) for a in arrivals]
                if not capacity_given and any(p.load_fraction is not None for p in asked):
                    asked.insert(0, SweepPoint(prompt, ratio, mode, "closed"))
                points += list(dict.fromkeys(asked))
    return points


@dataclass(frozen=True)
class PointSizes:
    l1_tokens: int  # each worker's device pool
    l2_tokens: int  # each worker's host pool
    num_clients: int  # conversations
    prompt: PromptClass
    working_set_tokens: int
    l3_max_bytes: int | None  # the small L3's cap; None: uncapped (or no L3)
    max_inflight: int  # closed loop

    @property
    def worker_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "l1_tokens": self.l1_tokens, "l2_tokens": self.l2_tokens,
            "num_clients": self.num_clients, "num_rounds": self.prompt.num_rounds,
            "request_length": self.prompt.request_length,
            "sub_question_length": self.prompt.sub_question_length,
            "output_length": self.prompt.output_length,
            "working_set_tokens": self.working_set_tokens, "l3_max_bytes": self.l3_max_bytes,
            "max_inflight": self.max_inflight,
        }


def point_sizes(
    point: SweepPoint, num_workers: int, hicache_ratio: float, kv_bytes_per_token: int,
) -> PointSizes:
    """See the module docstring."""
    prompt = PROMPT_CLASSES[point.prompt]
    conversation = prompt.conversation_tokens
    l1 = math.ceil(L1_CONTEXTS * conversation / L1_ROUND) * L1_ROUND
    l2 = int(l1 * hicache_ratio)
    clients = max(1, round(point.ws * num_workers * (l1 + l2) / conversation))
    working_set = clients * conversation
    cap = (
        int(SMALL_L3_SHARE * working_set * kv_bytes_per_token) if point.l3 == "small" else None
    )
    return PointSizes(l1, l2, clients, prompt, working_set, cap, 2 * num_workers)


@dataclass(frozen=True)
class SweepSettings:
    """The sweep's settings. The cluster's (``to_json``) must match the state file's; the
    run length may differ per session (e.g. longer for the long prompts: each point records
    its own), and so may the contenders (each is matched per point by its setting)."""

    num_workers: int
    worker_args: str
    hicache_ratio: float
    point_seconds: float
    open_max_seconds: float
    repeats: int
    kv_bytes_per_token: int
    contenders: tuple[Contender, ...]
    seed: int
    generations: int = 1  # conversations each live slot plays in turn

    def to_json(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "num_workers": self.num_workers, "worker_args": self.worker_args,
            "hicache_ratio": self.hicache_ratio, "repeats": self.repeats,
            "kv_bytes_per_token": self.kv_bytes_per_token, "seed": self.seed,
        }
        if self.generations != 1:  # absent from the state files of one generation
            settings["generations"] = self.generations
        return settings


def default_router_policy() -> str:
    """``hicache router``'s default --policy, as this hicache has it."""
    from hicache.router.settings import RouterSettings

    return RouterSettings().policy.value


def router_defaults() -> str:
    """``hicache router``'s defaults of the flags that decide where a request goes: a
    result taken before one changed is not the default contender's any more."""
    from hicache.router.settings import RouterSettings

    d = RouterSettings()
    weight = "auto" if d.overlap_weight is None else f"{d.overlap_weight:g}"
    return (f"--overlap-weight {weight} --load-term {d.load_term} --tier-costs "
            f"{d.tier_costs.value} --shared-cache-multiplier {d.shared_cache_multiplier:g} "
            f"--conversation-affinity {'on' if d.conversation_affinity else 'off'}"
            # Named once it differs from the first: results taken before it stay valid.
            + ("" if d.ttft_score == "own" else f" --ttft-score {d.ttft_score}"))


def contenders(args: argparse.Namespace) -> tuple[Contender, ...]:
    """Ours first (the default policy, then each --policies given), then SGLang's."""
    policies = [default_router_policy(), *(args.policies or [])]
    defaults = router_defaults()
    ours = [
        Contender(f"hicache-{p}", "hicache", p, args.router_args, None, defaults)
        for p in dict.fromkeys(policies)
    ]
    variants = list(dict.fromkeys(getattr(args, "variant_args", None) or []))
    for index, flags in enumerate(variants, 1):
        name = f"hicache-{policies[0]}-variant" + ("" if len(variants) == 1 else f"-{index}")
        ours.append(Contender(name, "hicache", policies[0],
                              f"{args.router_args} {flags}".strip(), None, defaults))
    theirs = [Contender("sglang", "sglang", SGLANG_POLICY, "", args.sglang_program)]
    tuned = list(dict.fromkeys(args.sglang_args or []))
    for index, flags in enumerate(tuned, 1):
        name = "sglang-tuned" if len(tuned) == 1 else f"sglang-tuned-{index}"
        theirs.append(Contender(name, "sglang", SGLANG_POLICY, flags, args.sglang_program))
    return (*ours, *theirs)


def settings_of(args: argparse.Namespace) -> SweepSettings:
    if not args.sweep_point_seconds > 0:
        raise RouterBenchError("--sweep-point-seconds must be > 0")
    if not args.sweep_open_max_seconds >= args.sweep_point_seconds:
        raise RouterBenchError("--sweep-open-max-seconds must be >= --sweep-point-seconds")
    if args.sweep_kv_bytes_per_token < 1:
        raise RouterBenchError("--sweep-kv-bytes-per-token must be >= 1")
    if args.repeats < 1:
        raise RouterBenchError("--repeats must be >= 1")
    if args.num_workers < 1:
        raise RouterBenchError("--num-workers must be >= 1")
    if not args.hicache_ratio > 1:
        raise RouterBenchError("--hicache-ratio must be > 1")
    if args.sweep_generations < 1:
        raise RouterBenchError("--sweep-generations must be >= 1")
    return SweepSettings(
        num_workers=args.num_workers, worker_args=args.worker_args,
        hicache_ratio=args.hicache_ratio, point_seconds=args.sweep_point_seconds,
        open_max_seconds=args.sweep_open_max_seconds,
        repeats=args.repeats, kv_bytes_per_token=args.sweep_kv_bytes_per_token,
        contenders=contenders(args), seed=args.seed, generations=args.sweep_generations,
    )


def run_order(names: Sequence[str], repeat: int) -> list[str]:
    """The contenders' order on repeat ``repeat`` (1-based): reversed on even repeats, so
    a slow drift of a shared machine hits them alike."""
    return list(names) if repeat % 2 else list(reversed(names))


def capacity_of(result: PointResult | None) -> float | None:
    """Successful requests per second of the reference (SGLang at its defaults) in a
    closed-loop point's result; None when it has none."""
    if result is None:
        return None
    return result.capacity_rps


def point_deadline(sizes: PointSizes, rate: float | None, settings: SweepSettings) -> float:
    """Seconds a run at the point may send for: ``--sweep-point-seconds`` in a closed loop;
    in an open one until the schedule's last turn arrives, within
    ``--sweep-open-max-seconds``, never shorter than the closed loop's."""
    if rate is None:
        return settings.point_seconds
    turns = sizes.prompt.num_rounds * settings.generations
    span = schedule_span(sizes.num_clients, turns, rate, settings.seed)
    # Just past the last arrival, so that its turn is not cut off by rounding.
    return max(settings.point_seconds, min(math.ceil(span) + 1.0, settings.open_max_seconds))


# ------------------------------------------------------------------------ one point
def _point_args(
    args: argparse.Namespace, sizes: PointSizes, point: SweepPoint, contender: Contender,
) -> argparse.Namespace:
    run_args = argparse.Namespace(**vars(args))
    prompt = sizes.prompt
    run_args.num_clients = sizes.num_clients
    run_args.num_rounds = prompt.num_rounds
    run_args.request_length = prompt.request_length
    run_args.sub_question_length = prompt.sub_question_length
    run_args.output_length = prompt.output_length
    run_args.max_total_tokens = sizes.l1_tokens
    run_args.hicache_size = None
    run_args.max_inflight = sizes.max_inflight
    run_args.policies = [contender.policy]
    run_args.router_args = contender.args
    run_args.router_program = contender.program
    if args.l3_extra_config:
        extra = json.loads(args.l3_extra_config)
    else:
        extra = dict(SMOKE_L3_EXTRA[L3Kind.FILE]) if args.smoke else {}
    if sizes.l3_max_bytes is not None:
        extra["max_bytes"] = sizes.l3_max_bytes
    run_args.l3_extra_config = json.dumps(extra) if extra else None
    run_args.l3 = L3Kind.FILE.value
    return run_args


def _plan(run_args: argparse.Namespace, point: SweepPoint) -> Plan:
    plan = make_plan(run_args)
    return replace(plan, l3=L3Kind.NONE) if point.l3 == "none" else plan


def _runner(spec: LoadSpec, args: argparse.Namespace, generations: int) -> Any:
    async def run(
        run_args: argparse.Namespace, sessions: Sequence[Session], maker: PromptMaker,
        url: str, label: str, config: dict[str, Any],
    ) -> RunSummary:
        if generations > 1:
            # The same first generation, then the conversations that follow it (the
            # workload's seeding is per conversation index).
            more = argparse.Namespace(**vars(run_args))
            more.num_clients = len(sessions) * generations
            sessions = multiturn_workload(more, maker)
        return await run_load(
            url, sessions, maker, spec, label, api=ApiStyle(args.api), model=args.model,
            warmup=args.warmup, request_timeout_s=args.request_timeout,
            log_file=run_args.log_file, config=config,
        )

    return run


def run_point(
    point: SweepPoint, args: argparse.Namespace, settings: SweepSettings, out_dir: Path,
    capacity_rps: float | None, todo: Sequence[Contender], previous: PointResult | None,
) -> PointResult:
    """The contenders of ``todo`` at ``point``, ``--repeats`` times, a fresh cluster each;
    ``previous``'s results of the others kept."""
    sizes = point_sizes(point, settings.num_workers, settings.hicache_ratio,
                        settings.kv_bytes_per_token)
    rate = None
    if point.load_fraction is not None:
        if not capacity_rps:
            sizes_json = {**sizes.to_json(), "point_seconds": settings.point_seconds,
                          "generations": settings.generations}
            return PointResult.failed(point.id, point_fields(point), sizes_json,
                                      "no capacity measured at the closed-loop point")
        rate = point.load_fraction * capacity_rps
    deadline = point_deadline(sizes, rate, settings)
    sizes_json = {**sizes.to_json(), "point_seconds": deadline,
                  "generations": settings.generations}
    spec = LoadSpec(
        deadline_s=deadline, max_inflight=sizes.max_inflight if rate is None else 0,
        rate=rate, seed=settings.seed, live=sizes.num_clients,
    )
    point_dir = out_dir / "points" / point.id
    point_dir.mkdir(parents=True, exist_ok=True)
    by_name = {c.name: c for c in todo}
    runs: list[tuple[Contender, PolicyRun]] = []
    for repeat in range(1, settings.repeats + 1):
        for name in run_order(list(by_name), repeat):
            contender = by_name[name]
            run_args = _point_args(args, sizes, point, contender)
            plan = _plan(run_args, point)
            config = args_config(run_args)
            config.update(point=point.id, contender=name, rate=rate)
            print(f"[{point.id}] {name}, repeat {repeat}", flush=True)
            run = run_policy(contender.policy, repeat, run_args, plan, point_dir, config,
                             name=name, runner=_runner(spec, args, settings.generations))
            status = "ok" if run.error is None else f"FAILED: {run.error.splitlines()[0]}"
            print(f"[{point.id}] {run.stem}: {status}", flush=True)
            runs.append((contender, run))
    return PointResult.of(point.id, point_fields(point), sizes_json, rate, capacity_rps,
                          runs, todo, previous)


def point_fields(point: SweepPoint) -> dict[str, Any]:
    return {"prompt": point.prompt, "ws": point.ws, "l3": point.l3, "arrival": point.arrival}


# ------------------------------------------------------------------------ main
def shared_cores_note(num_workers: int, cores: int) -> str | None:
    """A warning for the report when the workers outnumber the cores, else None."""
    if num_workers <= cores:
        return None
    return (
        f"- note: {num_workers} workers share {cores} CPU cores, so a busy worker slows the "
        "others and one worker alone computes faster than two side by side: a router "
        "that spreads requests pays for it here as it would not with a device per worker "
        "(on this 2-core machine SGLang's router, which spread the long prompts unevenly, "
        "had a 1.34-1.40x lower mean TTFT with 3 workers and none with 2, "
        "docs/benchmarks.md); run no more workers than cores to compare routing"
    )


def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    try:
        points = expand_grid(
            parse_ws(args.sweep_ws),
            parse_axis(args.sweep_l3, L3_MODES, "--sweep-l3"),
            parse_axis(args.sweep_arrival, ARRIVALS, "--sweep-arrival"),
            parse_axis(args.sweep_prompt, PROMPTS, "--sweep-prompt"),
            capacity_given=args.sweep_capacity is not None,
        )
        if args.sweep_capacity is not None and not args.sweep_capacity > 0:
            raise RouterBenchError("--sweep-capacity must be > 0")
        settings = settings_of(args)
        # Every plan checked before any process starts.
        for point in points:
            sizes = point_sizes(point, settings.num_workers, settings.hicache_ratio,
                                settings.kv_bytes_per_token)
            for contender in settings.contenders:
                _plan(_point_args(args, sizes, point, contender), point)
        state = SweepState.load(out_dir / "router_sweep.json", settings.to_json())
    except (RouterBenchError, WorkloadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # SGLang's router must not go looking for a tokenizer on the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir.mkdir(parents=True, exist_ok=True)
    header = [
        f"- started: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- cluster: {settings.num_workers} workers, `hicache serve "
        f"{settings.worker_args or '(defaults)'}`, fresh per run; L2 = "
        f"{settings.hicache_ratio:g} x L1; each worker's L1 holds {L1_CONTEXTS:g} of the "
        f"longest conversations",
        "- contenders: " + "; ".join(
            f"{c.name} (`{c.program or 'hicache router'} --policy {c.policy} {c.args}`)".replace(
                " `)", "`)") for c in settings.contenders),
        f"- each run stops sending after {settings.point_seconds:g} s in a closed loop, "
        "in an open one once every turn is sent (at most "
        f"{settings.open_max_seconds:g} s); this session's points, see Sizes; repeats: "
        f"{settings.repeats} (order reversed on even repeats); seed {settings.seed}; "
        f"{settings.generations} generation(s) of conversations a run",
        f"- CPUs: {os.cpu_count()} on the machine",
    ]
    note = shared_cores_note(settings.num_workers, len(os.sched_getaffinity(0)))
    if note is not None:
        header.append(note)
    print("\n".join(header), flush=True)
    todo = [p for p in points if state.missing(p.id, settings.contenders)]
    print(f"{len(points)} points asked, {len(points) - len(todo)} already done", flush=True)
    for point in todo:
        capacity = None
        if point.load_fraction is not None:
            capacity = args.sweep_capacity or capacity_of(
                state.result(point.capacity_point().id)
            )
        result = run_point(point, args, settings, out_dir, capacity,
                           state.missing(point.id, settings.contenders), state.result(point.id))
        state.record(result)
        state.save()
        write_sweep_report(state, [p.id for p in points], out_dir, header)
    md = write_sweep_report(state, [p.id for p in points], out_dir, header)
    print(md.read_text(encoding="utf-8"))
    print(f"wrote {md}")
    failed = any(state.missing(p.id, settings.contenders) for p in points)
    return 1 if failed else 0
