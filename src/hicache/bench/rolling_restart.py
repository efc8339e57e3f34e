"""``hicache bench rolling-restart``: a rolling restart of every worker behind the router,
under multi-turn traffic; how much of the prompt the cache still serves afterwards.

For each mode of ``--modes`` (a fresh cluster each): ``--num-workers`` ``hicache serve``
workers on a shared file L3 behind ``hicache router`` (``bench/cluster.py``), and
closed-loop multi-turn conversations through the router (``conversation_load.py``).
The run is cut into windows by the time a request is sent:

- ``warmup`` (``--warmup-s``): the conversations fill the caches; not compared;
- ``before`` (``--before-s``): steady traffic on the warm cluster;
- ``restart``: every worker in turn is stopped, by SIGTERM to the server (mode ``drain``:
  it drains, writes its pages to L3 and exits) or SIGKILL to its process group (mode
  ``kill``: a crash, what peers' restarts amount to), its exit code awaited, a new
  ``hicache serve`` started at the same port with the same flags, and the router waited
  for until it lists the worker as up again; the next worker follows;
- ``after`` (``--after-s``): the conversations keep going on the restarted cluster.

Reported per mode: failed requests (the target is 0), prompt tokens and cached prompt
tokens by tier in each window, the after/before ratio of the cached share (the target:
>= 0.8), each restart's durations and the stopped worker's exit code (0 for a drain).
The JSON (``--out``) has the raw counts; every ratio is computed from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.cache_tally import CacheTally, pct, ratio, times
from hicache.bench.cluster import Cluster, ClusterConfig, ClusterError, L3Kind, RouterConfig
from hicache.bench.conversation_load import ConversationLoad, ConversationShape
from hicache.bench.report import markdown_table
from hicache.bench.workload import PromptMaker, WorkloadError
from hicache.testing.server_process import ChildServer, ServerStartError

MODES = ("drain", "kill")
# Issue 33: the cached share after the restarts >= 0.8 of before, no request failed.
TARGET_RATIO = 0.8
WINDOWS = ("warmup", "before", "restart", "after")
TIERS = ("device", "host", "storage")
# The worker flags each --model stands for; "smollm2" is serve's default model.
MODEL_ARGS: dict[str, tuple[str, ...]] = {
    "smollm2": (),
    "tiny": ("--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
             "--num-threads", "1", "--hicache-storage-prefetch-policy", "wait_complete",
             # A tiny prompt may legitimately be recomputed under the cost policy: load
             # whatever a tier holds, so the tiers' share is what is measured.
             "--hicache-reuse-policy", "load"),
}
# Tiny prompts are shorter than the default prefetch threshold (256 tokens): L3 would
# never be read.
MODEL_L3_EXTRA: dict[str, dict[str, Any]] = {"smollm2": {}, "tiny": {"prefetch_threshold": 16}}
# The router probes each worker this often: it notices one leave or come back soon.
ROUTER_HEALTH_INTERVAL_S = 0.5
# Distinct failure messages kept in the report (the JSON stays small however many failed).
MAX_FAILURE_MESSAGES = 10


class RollingRestartError(RuntimeError):
    """The benchmark cannot run as configured."""


# ------------------------------------------------------------------------ flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--out", default="rolling_restart.json",
                         help="the JSON report (default: %(default)s)")
    cluster.add_argument("--run-dir", default=None,
                         help="logs of every run (default: the --out path with .runs)")
    cluster.add_argument("--model", choices=sorted(MODEL_ARGS), default="smollm2",
                         help="smollm2: serve's default model; tiny: the tiny dummy model on "
                         "CPU, for smoke runs (default: %(default)s)")
    cluster.add_argument("--worker-args", default="",
                         help="more flags for every `hicache serve` worker")
    cluster.add_argument("--num-workers", type=int, default=3, help="default: %(default)s")
    cluster.add_argument("--max-total-tokens", type=int, default=1536,
                         help="each worker's device pool (L1) in tokens (default: %(default)s)")
    cluster.add_argument("--hicache-ratio", type=float, default=2.0,
                         help="each worker's host pool (L2) as a multiple of L1 "
                         "(default: %(default)s)")
    cluster.add_argument("--drain-timeout-s", type=float, default=60.0,
                         help="each worker's --drain-timeout-s (default: %(default)s)")
    cluster.add_argument("--router-policy", default="tier_aware",
                         help="the router's --policy (default: %(default)s)")
    cluster.add_argument("--startup-timeout", type=float, default=300.0,
                         help="seconds a worker or the router may take to come up "
                         "(default: %(default)s)")
    run = parser.add_argument_group("restart")
    run.add_argument("--mode", choices=MODES, default="drain",
                     help="drain: SIGTERM (the worker drains); kill: SIGKILL, a crash "
                     "(default: %(default)s)")
    run.add_argument("--modes", default=None, metavar="MODE,MODE",
                     help="several modes side by side, a fresh cluster each, e.g. drain,kill "
                     "(instead of --mode)")
    run.add_argument("--warmup-s", type=float, default=30.0,
                     help="traffic before the 'before' window, not compared (default: "
                     "%(default)s)")
    run.add_argument("--before-s", type=float, default=120.0, help="default: %(default)s")
    run.add_argument("--after-s", type=float, default=120.0, help="default: %(default)s")
    load = parser.add_argument_group("conversations")
    load.add_argument("--conversations", type=int, default=12, help="default: %(default)s")
    load.add_argument("--in-flight", type=int, default=6,
                      help="requests under way at most (default: %(default)s)")
    load.add_argument("--first-prompt-tokens", type=int, default=384,
                      help="default: %(default)s")
    load.add_argument("--round-tokens", type=int, default=64,
                      help="tokens each later round adds after the answer (default: "
                      "%(default)s)")
    load.add_argument("--output-tokens", type=int, default=16, help="default: %(default)s")
    load.add_argument("--max-rounds", type=int, default=8,
                      help="then a conversation starts over as a new one (default: "
                      "%(default)s)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds per request (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Plan:
    modes: tuple[str, ...]
    shape: ConversationShape
    worker_args: tuple[str, ...]
    l3_extra: dict[str, Any]


def make_plan(args: argparse.Namespace) -> Plan:
    modes = tuple(m.strip() for m in args.modes.split(",")) if args.modes else (args.mode,)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise RollingRestartError(f"--modes: {', '.join(unknown) or '(none)'} is not one of "
                                  f"{', '.join(MODES)}")
    if args.num_workers < 1:
        raise RollingRestartError("--num-workers must be >= 1")
    if args.conversations < 1 or args.in_flight < 1:
        raise RollingRestartError("--conversations and --in-flight must be >= 1")
    if min(args.warmup_s, args.before_s, args.after_s) < 0:
        raise RollingRestartError("--warmup-s, --before-s and --after-s must be >= 0")
    if not args.hicache_ratio > 1:
        raise RollingRestartError("--hicache-ratio must be > 1")
    shape = ConversationShape(args.first_prompt_tokens, args.round_tokens, args.output_tokens,
                              args.max_rounds)
    shape.check_fits(args.max_total_tokens, "--max-total-tokens")
    worker_args = (*MODEL_ARGS[args.model], *shlex.split(args.worker_args),
                   "--drain-timeout-s", f"{args.drain_timeout_s:g}")
    return Plan(modes, shape, worker_args, dict(MODEL_L3_EXTRA[args.model]))


# ------------------------------------------------------------------------ one run
@dataclass
class Restart:
    """One worker stopped and started again."""

    worker: int
    exit_code: int | None = None
    stop_s: float = 0.0  # signal to exit
    start_s: float = 0.0  # exit to the new server answering /health
    routed_s: float = 0.0  # /health to the router listing it as up
    total_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ModeRun:
    mode: str
    windows: dict[str, CacheTally] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)
    # The failed requests' errors: the most frequent messages, each with its count.
    failures: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def failed(self) -> int:
        return sum(t.failed for t in self.windows.values())

    @property
    def cached_share_ratio(self) -> float | None:
        """The after window's cached share over the before window's."""
        before, after = self.windows.get("before"), self.windows.get("after")
        if before is None or after is None:
            return None
        return ratio(after.cached_share, before.cached_share)

    @property
    def target_met(self) -> bool | None:
        """No failed request and the after/before ratio >= TARGET_RATIO; None when the
        ratio could not be measured."""
        share_ratio = self.cached_share_ratio
        if self.error is not None or share_ratio is None:
            return None
        return self.failed == 0 and share_ratio >= TARGET_RATIO

    @property
    def ok(self) -> bool:
        drained_clean = self.mode != "drain" or all(r.exit_code == 0 for r in self.restarts)
        return self.error is None and self.failed == 0 and drained_clean

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "error": self.error, "failed": self.failed,
            "windows": {name: tally.to_json() for name, tally in self.windows.items()},
            "cached_share_ratio": self.cached_share_ratio, "target_ratio": TARGET_RATIO,
            "target_met": self.target_met,
            "restarts": [r.to_json() for r in self.restarts], "failures": self.failures,
        }


def run_mode(mode: str, args: argparse.Namespace, plan: Plan, run_dir: Path) -> ModeRun:
    """A fresh cluster, the conversations through its router, every worker restarted;
    everything stopped again. A failure is recorded in the result."""
    run = ModeRun(mode)
    config = ClusterConfig(
        run_dir, num_workers=args.num_workers, worker_args=plan.worker_args,
        max_total_tokens=args.max_total_tokens, hicache_ratio=args.hicache_ratio,
        l3=L3Kind.FILE, l3_extra=plan.l3_extra,
        router=RouterConfig(args.router_policy, (
            "--health-interval", f"{ROUTER_HEALTH_INTERVAL_S:g}")),
        startup_timeout_s=args.startup_timeout,
    )
    restarted: list[ChildServer] = []
    load: ConversationLoad | None = None
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh L3, also when --run-dir is reused
    try:
        print(f"[{mode}] starting {args.num_workers} workers and the router", flush=True)
        with Cluster(config) as cluster:
            load = ConversationLoad(
                cluster.url, plan.shape, args.conversations, args.in_flight,
                PromptMaker(), seed=args.seed, timeout_s=args.request_timeout,
                phase="warmup")
            load.start()
            try:
                time.sleep(args.warmup_s)  # the windows are the benchmark's own durations
                load.phase = "before"
                time.sleep(args.before_s)
                load.phase = "restart"
                for worker in cluster.workers:
                    print(f"[{mode}] restarting worker {worker.index}", flush=True)
                    restart = Restart(worker.index)
                    run.restarts.append(restart)
                    restarted.append(restart_worker(cluster, worker.server, mode, args,
                                                    run_dir, restart))
                load.phase = "after"
                time.sleep(args.after_s)
            finally:
                load.stop()
                for server in restarted:
                    server.stop()
    except (ClusterError, ServerStartError, WorkloadError, RollingRestartError, OSError,
            RuntimeError, subprocess.TimeoutExpired) as error:
        run.error = f"{type(error).__name__}: {error}"
    finally:
        # The L3's pages are the big part of a run directory and are never looked at again.
        shutil.rmtree(run_dir / "l3", ignore_errors=True)
    if load is not None:
        records = load.records()
        run.windows = {name: CacheTally.of(r.record for r in records if r.phase == name)
                       for name in WINDOWS}
        errors = Counter(f"{r.phase}: {(r.record.error or '')[:200]}"
                         for r in records if not r.record.ok)
        run.failures = dict(errors.most_common(MAX_FAILURE_MESSAGES))
    return run


def restart_worker(
    cluster: Cluster, server: ChildServer, mode: str, args: argparse.Namespace,
    run_dir: Path, restart: Restart,
) -> ChildServer:
    """Stop ``server`` as ``mode`` says, start a new one at its port with its flags, and
    wait until the router lists it as up; ``restart`` gets the timings and exit code."""
    process = server.process
    if process is None:
        raise RollingRestartError(f"worker {restart.worker} was never started")
    began = time.monotonic()
    if mode == "drain":
        # The server alone, as an orchestrator signals it; it drains and exits.
        process.send_signal(signal.SIGTERM)
        restart.exit_code = process.wait(timeout=args.drain_timeout_s + args.startup_timeout)
        server.stop()  # whatever of its process group is left
    else:
        restart.exit_code = server.kill()
    exited = time.monotonic()
    restart.stop_s = exited - began
    new = ChildServer(
        server.command, server.port, run_dir / f"worker-{restart.worker}.restarted.log",
        env=server.env, startup_timeout_s=args.startup_timeout,
        name=f"worker {restart.worker} restarted")
    new.start()
    ready = time.monotonic()
    restart.start_s = ready - exited
    if not _wait_for(lambda: _router_state(cluster.url, new.url) == "up", args.startup_timeout):
        new.stop()
        raise RollingRestartError(
            f"the router did not route to restarted worker {restart.worker} within "
            f"{args.startup_timeout:g} s")
    routed = time.monotonic()
    restart.routed_s = routed - ready
    restart.total_s = routed - began
    return new


def _router_state(router_url: str, worker_url: str) -> str | None:
    """The worker's state in the router's /workers (up, draining, down); None unknown."""
    try:
        with urllib.request.urlopen(f"{router_url}/workers", timeout=10) as response:
            workers = json.loads(response.read())["workers"]
    except (OSError, ValueError, KeyError):
        return None
    return next((str(w.get("state")) for w in workers if w.get("url") == worker_url), None)


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ------------------------------------------------------------------------ report
def report_table(runs: list[ModeRun]) -> str:
    """Per mode: the windows compared and the restarts."""
    headers = ["mode", "failed", "before prompt", "before cached", "during restarts cached",
               "after prompt", "after cached", "after/before", "restart s (each)",
               "exit codes", "target"]
    rows = []
    for run in runs:
        before = run.windows.get("before", CacheTally())
        during = run.windows.get("restart", CacheTally())
        after = run.windows.get("after", CacheTally())
        rows.append([
            run.mode, run.failed, before.prompt_tokens, _cached_cell(before),
            _cached_cell(during), after.prompt_tokens, _cached_cell(after),
            times(run.cached_share_ratio),
            " ".join(f"{r.total_s:.1f}" for r in run.restarts) or "-",
            " ".join(str(r.exit_code) for r in run.restarts) or "-",
            {True: "met", False: "NOT met", None: "-"}[run.target_met],
        ])
    return markdown_table(headers, rows)


def _cached_cell(tally: CacheTally) -> str:
    split = "/".join(str(tally.cached_by_tier.get(tier, 0)) for tier in TIERS)
    return f"{pct(tally.cached_share)} (d/h/s {split})"


def main(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(args)
    except (RollingRestartError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    run_root = Path(args.run_dir) if args.run_dir else out.with_name(out.name + ".runs")
    header = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "cpus": os.cpu_count(), "model": args.model, "worker_args": list(plan.worker_args),
        "num_workers": args.num_workers, "conversations": args.conversations,
        "in_flight": args.in_flight, "first_prompt_tokens": args.first_prompt_tokens,
        "round_tokens": args.round_tokens, "output_tokens": args.output_tokens,
        "max_rounds": args.max_rounds, "warmup_s": args.warmup_s, "before_s": args.before_s,
        "after_s": args.after_s, "max_total_tokens": args.max_total_tokens,
        "hicache_ratio": args.hicache_ratio, "router_policy": args.router_policy,
    }
    runs = []
    for mode in plan.modes:
        run = run_mode(mode, args, plan, run_root / mode)
        runs.append(run)
        print(f"[{mode}] {'ok' if run.error is None else 'FAILED: ' + run.error}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": header, "runs": [r.to_json() for r in runs]},
                              indent=2) + "\n", encoding="utf-8")
    print(report_table(runs))
    for run in runs:
        for message, count in run.failures.items():
            print(f"[{run.mode}] {count} failed: {message}")
    print(f"wrote {out}")
    return 0 if all(run.ok for run in runs) else 1
