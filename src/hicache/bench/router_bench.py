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
mean TTFT than cache_aware) are checked when those policies ran (router_report.py).
Results go to ``--out-dir``: ``router_bench.md``, ``router_bench.json``, each run's summary,
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
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from hicache.bench.report import RunSummary, read_jsonl
from hicache.bench.router_report import PolicyRun, write_report
from hicache.bench.scrape import Samples, scrape
from hicache.bench.ttft_prediction import read_predictions
from hicache.bench.turn_placement import placement, workers_of
from hicache.bench.workload import PromptMaker, Session, WorkloadError
from hicache.router.decisions import MAX_DECISIONS
from hicache.testing.server_process import ServerStartError

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_load", "cache_aware", "tier_aware", "predicted_ttft")
DEFAULT_POLICIES = ("round_robin", "cache_aware", "tier_aware")

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
        "--policies", nargs="+", choices=POLICIES, default=None,
        metavar="POLICY", help=f"router policies to compare, of {', '.join(POLICIES)} "
        f"(default: {' '.join(DEFAULT_POLICIES)}; with --sweep: the router's default policy, "
        "these run too)",
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
    add_sweep_arguments(parser)
    add_client_arguments(parser, url_required=False)
    add_multiturn_arguments(parser)
    # None: not given, so --smoke or the defaults above decide.
    parser.set_defaults(**dict.fromkeys(DEFAULTS))


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sweep`` and its axes (bench/router_sweep.py)."""
    group = parser.add_argument_group(
        "sweep", "hicache router against SGLang's over issue 34's grid (bench/router_sweep.py); "
        "the workload's sizes come from each point, so the multi-turn size flags are ignored")
    group.add_argument(
        "--sweep", action="store_true",
        help="run the grid: per point hicache router (its default policy, plus --policies) and "
        "SGLang's cache_aware, a fresh cluster per run; resumes from --out-dir's "
        "router_sweep.json",
    )
    group.add_argument("--sweep-ws", default="0.5,1,2,4", metavar="LIST",
                       help="working set / the cluster's L1 + L2 (default: %(default)s)")
    group.add_argument("--sweep-l3", default="none,small,all", metavar="LIST",
                       help="shared L3: none, small (half the working set), all "
                       "(default: %(default)s)")
    group.add_argument("--sweep-arrival", default="closed,poisson50,poisson90", metavar="LIST",
                       help="closed loop, or Poisson arrivals at 50%% / 90%% of the closed "
                       "loop's measured capacity (default: %(default)s)")
    group.add_argument("--sweep-prompt", default="short,long", metavar="LIST",
                       help="first prompt of 256 (short) or 2,048 (long) tokens "
                       "(default: %(default)s)")
    group.add_argument("--sweep-point-seconds", type=float, default=40.0, metavar="S",
                       help="a closed-loop run sends no request after this many seconds "
                       "(default: %(default)s)")
    group.add_argument("--sweep-open-max-seconds", type=float, default=300.0, metavar="S",
                       help="an open-loop run sends until every turn of every conversation "
                       "has arrived, but no longer than this (default: %(default)s)")
    group.add_argument("--sweep-generations", type=int, default=1, metavar="G",
                       help="each conversation is followed by G - 1 fresh ones, as many "
                       "alive at once: a run sends up to G times the turns at the same "
                       "working set (default: %(default)s)")
    group.add_argument("--sweep-capacity", type=float, default=None, metavar="RPS",
                       help="requests a second the Poisson points take as the capacity, "
                       "instead of measuring it at each one's closed-loop point first "
                       "(which then is not run unless asked)")
    group.add_argument("--sweep-kv-bytes-per-token", type=int, default=46080, metavar="BYTES",
                       help="KV bytes per token, to size the small L3 (default: %(default)s, "
                       "SmolLM2-135M in f32)")
    group.add_argument("--sglang-program", default=None, metavar="COMMAND",
                       help="SGLang's router (default: python -m sglang_router.launch_router)")
    group.add_argument("--sglang-args", action="append", default=None, metavar="FLAGS",
                       help="also run SGLang's router with these flags, e.g. "
                       "'--cache-threshold 0.3 --balance-abs-threshold 16' (repeat for more "
                       "settings; the best per metric is the reference)")
    group.add_argument("--variant-args", action="append", default=None, metavar="FLAGS",
                       help="also run hicache router's default policy with these flags added "
                       "to --router-args, e.g. '--conversation-affinity off' (repeat for "
                       "more; each is its own contender, in the same alternation)")


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill each size not given on the command line from --smoke's or the defaults."""
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Only the router bench has --policies (the PD bench shares these sizes, not that flag).
    if getattr(args, "policies", False) is None and not getattr(args, "sweep", False):
        args.policies = list(DEFAULT_POLICIES)


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


# Plays the workload through the router at ``url`` (run_benchmark's signature): the sweep
# passes its own closed- or open-loop player (bench/sweep_load.py).
Runner = Callable[
    [argparse.Namespace, Sequence[Session], PromptMaker, str, str, dict[str, Any]],
    Coroutine[Any, Any, RunSummary],
]


def run_policy(
    policy: str, repeat: int, args: argparse.Namespace, plan: Plan, out_dir: Path,
    config_json: dict[str, Any], *, name: str | None = None, runner: Runner | None = None,
) -> PolicyRun:
    """A fresh cluster for ``policy``, the workload through its router, everything
    stopped. A failure is recorded in the result (the other runs still go). ``name``
    labels the run (default: the policy), e.g. when two routers run the same policy."""
    name = name or policy
    stem = f"{name}.{repeat}" if args.repeats > 1 else name
    run = PolicyRun(name, repeat, stem)
    run_dir = out_dir / "runs" / stem
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh L3 each run, also when --out-dir is reused
    log_file = out_dir / f"{stem}.jsonl"
    try:
        config = cluster_config(args, plan, policy, run_dir)
        print(f"[{stem}] starting {args.num_workers} workers and the router", flush=True)
        with Cluster(config) as cluster:
            worker_logs = [worker.log_path for worker in cluster.workers]
            run_args = argparse.Namespace(**vars(args))
            run_args.log_file = str(log_file)
            sessions = multiturn_workload(args, prompt_maker(args))
            run.load_before = os.getloadavg()
            try:
                run.summary = asyncio.run((runner or run_benchmark)(
                    run_args, sessions, prompt_maker(args), cluster.url, stem,
                    {**config_json, "policy": policy, "router_command": cluster.router_args(
                        config.router) if config.router else None},
                ))
            finally:
                run.load_after = os.getloadavg()
            run.worker_requests = _worker_requests(cluster)
            metrics = _save_metrics(cluster.url, run_dir / "router-metrics.txt", "router")
            for k, worker in enumerate(cluster.workers):
                # Each worker's counters (L3 reads, load-or-recompute choices): why a
                # router's requests found what they found.
                _save_metrics(worker.url, run_dir / f"worker-{k}-metrics.txt", f"worker {k}")
            if metrics is not None:
                run.notes += _shared_query_notes(metrics)
            _save_router_decisions(cluster, run_dir / "router-decisions.json")
        run.records = read_jsonl(log_file)
        run.placement = placement(run.records, workers_of(worker_logs))
        run.predictions = read_predictions(run_dir / "router-decisions.json")
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


def _save_metrics(url: str, path: Path, what: str) -> str | None:
    """A server's /metrics at the end of the run, as it was (a file next to its log);
    None when it could not be read."""
    try:
        import urllib.request

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            body: bytes = response.read()
    except OSError as error:
        logger.warning("%s metrics not saved: %s", what, error)
        return None
    path.write_bytes(body)
    return body.decode(errors="replace")


def _save_router_decisions(cluster: Cluster, path: Path) -> None:
    """Our router's last decisions (``/decisions``: each worker's logit and cached prefix,
    predicted and measured TTFT) next to its log, to check why it sent what where; another
    router (``--router-program``) has no such route and nothing is saved."""
    import urllib.error
    import urllib.request

    url = f"{cluster.url}/decisions?limit={MAX_DECISIONS}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            path.write_bytes(response.read())
    except urllib.error.HTTPError as error:
        if error.code != 404:
            logger.warning("router decisions not saved: %s", error)
    except OSError as error:
        logger.warning("router decisions not saved: %s", error)


def _shared_query_notes(metrics_text: str) -> list[str]:
    """How the router's shared-L3 queries ended (tier_aware with a shared pool), as a note."""
    try:
        outcomes = Samples.parse(metrics_text).by_label(
            "router_shared_cache_queries_total", "outcome")
    except ValueError:  # another router's /metrics (--router-program)
        return []
    total = sum(outcomes.values())
    if not total:
        return []
    counts = ", ".join(f"{outcomes.get(name, 0):.0f} {name}"
                       for name in ("answered", "late", "failed"))
    return [f"shared-L3 queries: {outcomes.get('answered', 0) / total:.1%} answered in time "
            f"({counts})"]


# ------------------------------------------------------------------------ main
def main(args: argparse.Namespace) -> int:
    resolve_sizes(args)
    if args.sweep:
        from hicache.bench import router_sweep

        if args.sglang_program is None:
            args.sglang_program = router_sweep.SGLANG_PROGRAM
        return router_sweep.main(args)
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
