"""``hicache bench router``: one multi-turn workload through the router, once per policy.

For each policy of ``--policies`` (default round_robin, cache_aware, tier_aware)
a fresh cluster starts (bench/cluster.py): ``--num-workers`` ``hicache serve``
workers on one fresh L3 (a file directory, or a Mooncake master), each
publishing KV events, and ``hicache router --policy <policy>`` in front. The
multi-turn conversations of ``hicache bench multiturn`` (the same generator
``hicache bench compare`` uses) run through the router; then everything stops.
With ``--repeats N`` the policies alternate N times, so a slow drift of a
shared machine hits them alike.

Sizes: each worker's device pool (``--max-total-tokens``) and host pool
(``--hicache-ratio`` / ``--hicache-size``) are small next to the conversations'
working set, so one worker cannot keep every conversation: prefixes live on
other workers' hosts and in L3, and where a request goes decides which tier
serves it. The header states the working set against one worker's L1 + L2.

Reported per policy (pooled over its repeats): throughput, mean / p50 / p99
TTFT, the share of prompt tokens served from each tier (device, host, L3 from
the responses' cached-token details, recomputed: the rest), the requests each
worker accepted (its own counter), and the load average around every run; the
issue's targets (tier_aware >= 1.3x round_robin's throughput, >= 25% lower
mean TTFT than cache_aware) are checked when those policies ran. Results go to
``--out-dir``: ``router_bench.md``, ``router_bench.json``, each run's summary,
request log, and the cluster's logs under ``runs/<policy>.<repeat>/``.

``--router-program`` runs another router that takes the same flags
(``--host --port --worker-urls --policy``), e.g. SGLang's:
``--router-program "python -m sglang_router.launch_router"``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.aggregate import LoadAverage, RunResult, aggregates, runs_table
from hicache.bench.client import TIERS
from hicache.bench.cluster import (
    Cluster,
    ClusterConfig,
    ClusterError,
    L3Kind,
    RouterConfig,
    router_available,
)
from hicache.bench.multiturn import (
    BenchmarkError,
    add_client_arguments,
    add_multiturn_arguments,
    args_config,
    multiturn_working_set,
    multiturn_workload,
    prompt_maker,
    run_benchmark,
)
from hicache.bench.report import RequestRecord, RunSummary, Stats, markdown_table, read_jsonl
from hicache.bench.scrape import scrape
from hicache.bench.server_process import ServerStartError
from hicache.bench.workload import WorkloadError

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_load", "cache_aware", "tier_aware")
DEFAULT_POLICIES = ("round_robin", "cache_aware", "tier_aware")
# The targets: tier_aware over round_robin (throughput), and under cache_aware (TTFT).
TARGET_THROUGHPUT_RATIO = 1.3
TARGET_TTFT_REDUCTION = 0.25

# Default sizes: SmolLM2 (serve's default model) on a few CPU cores, a few minutes a policy.
# 12 conversations of 384 + 3 x (16 + 64) + 16 tokens: a working set of 7,680 tokens, 1.7x
# one worker's L1 + L2 (1536 + 3072). L1 still holds the two longest requests at once (6 in
# flight over 3 workers).
DEFAULTS: dict[str, Any] = {
    "worker_args": "", "max_total_tokens": 1536, "hicache_ratio": 2.0,
    "num_clients": 12, "num_rounds": 4, "request_length": 384, "sub_question_length": 64,
    "output_length": 16, "max_inflight": 6, "warmup": 1,
}
# --smoke: the tiny dummy model, a few short conversations; seconds a policy.
SMOKE: dict[str, Any] = {
    "worker_args": (
        "--load-format dummy --model-preset tiny --device cpu --num-threads 1 "
        "--hicache-storage-prefetch-policy wait_complete"
    ),
    "max_total_tokens": 512, "hicache_ratio": 2.0,
    "num_clients": 6, "num_rounds": 3, "request_length": 192, "sub_question_length": 32,
    "output_length": 4, "max_inflight": 3, "warmup": 1,
}
# Its prompts are shorter than the default prefetch threshold (256 tokens): L3 would
# never be read. Mooncake lends a small segment: a few pages of a tiny model.
SMOKE_L3_EXTRA: dict[L3Kind, dict[str, Any]] = {
    L3Kind.FILE: {"prefetch_threshold": 16},
    L3Kind.MOONCAKE: {
        "prefetch_threshold": 16, "global_segment_size": "64MiB", "local_buffer_size": "16MiB",
    },
}


class RouterBenchError(RuntimeError):
    """The benchmark cannot run as configured."""


# ------------------------------------------------------------------------ flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--out-dir", required=True, help="where results and logs go")
    group.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(DEFAULT_POLICIES),
        metavar="POLICY", help=f"router policies to compare, of {', '.join(POLICIES)} "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--repeats", type=int, default=1, metavar="N",
        help="run every policy N times, alternating (default: %(default)s)",
    )
    group.add_argument("--num-workers", type=int, default=3, help="default: %(default)s")
    group.add_argument(
        "--worker-args", default=None,
        help="flags for every `hicache serve` worker (model, device, page size, ...); "
        f"default: none (SmolLM2); --smoke: {SMOKE['worker_args']!r}",
    )
    group.add_argument(
        "--max-total-tokens", type=int, default=None,
        help=f"each worker's device pool (L1) in tokens (default: {DEFAULTS['max_total_tokens']})",
    )
    group.add_argument(
        "--hicache-ratio", type=float, default=None,
        help=f"each worker's host pool (L2) as a multiple of L1 (default: "
        f"{DEFAULTS['hicache_ratio']:g})",
    )
    group.add_argument(
        "--hicache-size", type=float, default=None, metavar="GB",
        help="each worker's host pool in GB (instead of --hicache-ratio)",
    )
    group.add_argument(
        "--l3", choices=[L3Kind.FILE.value, L3Kind.MOONCAKE.value], default=L3Kind.FILE.value,
        help="the shared L3: a fresh file directory or a fresh Mooncake master per run "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--l3-extra-config", default=None, metavar="JSON",
        help='more L3 backend extra config for every worker, e.g. \'{"max_bytes": "2GB"}\'',
    )
    group.add_argument(
        "--router-args", default="",
        help="more `hicache router` flags for every run, e.g. \"--shared-cache-type hicache "
        "--shared-cache-multiplier 1\" ({master_address} becomes the Mooncake master's)",
    )
    group.add_argument(
        "--router-program", default=None, metavar="COMMAND",
        help="run this router instead of `hicache router` (it must take --host, --port, "
        "--worker-urls and --policy), e.g. 'python -m sglang_router.launch_router'",
    )
    group.add_argument(
        "--startup-timeout", type=float, default=300.0,
        help="seconds each worker and the router may take to come up (default: %(default)s)",
    )
    group.add_argument(
        "--smoke", action="store_true",
        help="CPU-sized run for CI: the tiny dummy model and a few short conversations "
        "(explicit flags still win)",
    )
    add_client_arguments(parser, url_required=False)
    add_multiturn_arguments(parser)
    # None: not given, so --smoke or the defaults above decide.
    parser.set_defaults(**dict.fromkeys(DEFAULTS))


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill each size not given on the command line from --smoke's or the defaults."""
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


# ------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Plan:
    """What ``main`` runs, checked before any process starts."""

    policies: tuple[str, ...]
    worker_args: tuple[str, ...]
    router_args: tuple[str, ...]
    router_program: tuple[str, ...] | None
    l3: L3Kind
    l3_extra: dict[str, Any]
    working_set_tokens: int
    notes: tuple[str, ...]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.repeats < 1:
        raise RouterBenchError("--repeats must be >= 1")
    if args.num_workers < 1:
        raise RouterBenchError("--num-workers must be >= 1")
    if not args.policies:
        raise RouterBenchError("--policies: name at least one")
    if args.max_total_tokens < 1:
        raise RouterBenchError("--max-total-tokens must be >= 1")
    if args.hicache_size is None and not args.hicache_ratio > 1:
        raise RouterBenchError("--hicache-ratio must be > 1")
    l3 = L3Kind(args.l3)
    extra: dict[str, Any] = {}
    if args.l3_extra_config:
        try:
            extra = json.loads(args.l3_extra_config)
        except ValueError as error:
            raise RouterBenchError(f"--l3-extra-config is not JSON: {error}") from None
        if not isinstance(extra, dict):
            raise RouterBenchError("--l3-extra-config must be a JSON object")
    elif args.smoke:
        extra = dict(SMOKE_L3_EXTRA[l3])
    program = tuple(shlex.split(args.router_program)) if args.router_program else None
    if program is None and not router_available():
        raise RouterBenchError(
            "`hicache router` is not a command of this hicache; give --router-program"
        )
    working_set = multiturn_working_set(args)
    notes = [f"working set: {working_set} tokens (every conversation's whole context)"]
    l1 = args.max_total_tokens
    if args.hicache_size is None:
        l2 = int(l1 * args.hicache_ratio)
        notes.append(
            f"each worker: L1 {l1} tokens + L2 {l2} tokens (--hicache-ratio "
            f"{args.hicache_ratio:g}); working set / (L1 + L2) = {working_set / (l1 + l2):.2f}"
        )
        if working_set <= l1 + l2:
            notes.append(
                "WARNING: one worker's L1 + L2 holds the whole working set; the policies "
                "then differ little (raise --num-clients or lower the pools)"
            )
    else:
        notes.append(f"each worker: L1 {l1} tokens + L2 {args.hicache_size:g} GB")
    return Plan(
        policies=tuple(args.policies), worker_args=tuple(shlex.split(args.worker_args)),
        router_args=tuple(shlex.split(args.router_args)), router_program=program, l3=l3,
        l3_extra=extra, working_set_tokens=working_set, notes=tuple(notes),
    )


# ------------------------------------------------------------------------ runs
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
        }


def cluster_config(
    args: argparse.Namespace, plan: Plan, policy: str, run_dir: Path
) -> ClusterConfig:
    return ClusterConfig(
        run_dir, num_workers=args.num_workers, worker_args=plan.worker_args,
        max_total_tokens=args.max_total_tokens,
        hicache_ratio=None if args.hicache_size is not None else args.hicache_ratio,
        hicache_size_gb=args.hicache_size, l3=plan.l3, l3_extra=plan.l3_extra,
        # Another router (--router-program) may be driving workers without events.
        kv_events=plan.router_program is None,
        router=RouterConfig(policy, plan.router_args, plan.router_program),
        startup_timeout_s=args.startup_timeout,
    )


def run_policy(
    policy: str, repeat: int, args: argparse.Namespace, plan: Plan, out_dir: Path,
    config_json: dict[str, Any],
) -> PolicyRun:
    """A fresh cluster for ``policy``, the workload through its router, everything
    stopped. A failure is recorded in the result (the other runs still go)."""
    stem = f"{policy}.{repeat}" if args.repeats > 1 else policy
    run = PolicyRun(policy, repeat, stem)
    run_dir = out_dir / "runs" / stem
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh L3 each run, also when --out-dir is reused
    log_file = out_dir / f"{stem}.jsonl"
    try:
        config = cluster_config(args, plan, policy, run_dir)
        print(f"[{stem}] starting {args.num_workers} workers and the router", flush=True)
        with Cluster(config) as cluster:
            run_args = argparse.Namespace(**vars(args))
            run_args.log_file = str(log_file)
            sessions = multiturn_workload(args, prompt_maker(args))
            run.load_before = os.getloadavg()
            try:
                run.summary = asyncio.run(run_benchmark(
                    run_args, sessions, prompt_maker(args), cluster.url, stem,
                    {**config_json, "policy": policy, "router_command": cluster.router_args(
                        config.router) if config.router else None},
                ))
            finally:
                run.load_after = os.getloadavg()
            run.worker_requests = _worker_requests(cluster)
            _save_router_metrics(cluster, run_dir / "router-metrics.txt")
        run.records = read_jsonl(log_file)
    except (ClusterError, ServerStartError, BenchmarkError, WorkloadError, OSError) as error:
        run.error = str(error)
    except Exception as error:  # one broken run must not stop the others
        logger.exception("run %s failed", stem)
        run.error = f"{type(error).__name__}: {error}"
    finally:
        run.load_before = run.load_before or os.getloadavg()
        run.load_after = run.load_after or os.getloadavg()
        # The L3's pages are the big part of a run directory and are never looked at again.
        shutil.rmtree(run_dir / "l3", ignore_errors=True)
    if run.summary is not None:
        run.summary.save(out_dir / f"{stem}.json")
        if run.summary.overall.failed:
            run.notes.append(f"{run.summary.overall.failed} requests failed")
    return run


def _worker_requests(cluster: Cluster) -> list[float]:
    """Requests each worker accepted (its own counter: warm-up included)."""
    counts = []
    for worker in cluster.workers:
        try:
            counts.append(scrape(worker.url).total("hicache_requests_total"))
        except OSError:
            counts.append(float("nan"))
    return counts


def _save_router_metrics(cluster: Cluster, path: Path) -> None:
    """The router's /metrics at the end of the run, as it was (a file next to its log)."""
    try:
        import urllib.request

        with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=10) as response:
            path.write_bytes(response.read())
    except OSError as error:
        logger.warning("router metrics not saved: %s", error)


# ------------------------------------------------------------------------ report
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


# ------------------------------------------------------------------------ main
def main(args: argparse.Namespace) -> int:
    resolve_sizes(args)
    out_dir = Path(args.out_dir)
    try:
        plan = make_plan(args)
    except (RouterBenchError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    args.no_progress = args.no_progress or not sys.stderr.isatty()
    config_json = args_config(args)
    config_json["working_set_tokens"] = plan.working_set_tokens
    router = shlex.join(plan.router_program) if plan.router_program else "hicache router"
    header = [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- workload: multiturn, {args.num_clients} clients x {args.num_rounds} rounds, first "
        f"prompt {args.request_length} tokens, +{args.sub_question_length} per round, output "
        f"{args.output_length}; max in flight {args.max_inflight or 'unlimited'}; api "
        f"{args.api}; seed {args.seed}",
        f"- cluster: {args.num_workers} workers, `hicache serve "
        f"{shlex.join(plan.worker_args) or '(defaults)'}`; L3 {plan.l3.value} (fresh per run)",
        f"- router: `{router} --policy POLICY {shlex.join(plan.router_args)}`".rstrip(),
        *(f"- {note}" for note in plan.notes),
        f"- policies: {', '.join(plan.policies)}; repeats: {args.repeats} (alternating)",
        f"- CPUs: {os.cpu_count()} on the machine",
    ]
    print("\n".join(header), flush=True)
    runs: list[PolicyRun] = []
    for repeat in range(1, args.repeats + 1):
        for policy in plan.policies:
            run = run_policy(policy, repeat, args, plan, out_dir, config_json)
            runs.append(run)
            status = "ok" if run.error is None else f"FAILED: {run.error.splitlines()[0]}"
            print(f"[{run.stem}] {status}", flush=True)
    md = write_report(runs, out_dir, header)
    print(md.read_text(encoding="utf-8").split("\n## Per policy", 1)[1])
    print(f"wrote {md}")
    failed = any(r.error is not None or (r.summary and r.summary.overall.failed) for r in runs)
    return 1 if failed or not runs else 0
