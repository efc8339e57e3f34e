"""``hicache bench pd``: one multi-turn workload on one instance, then on a disaggregated pair.

Two setups, each a fresh cluster (bench/cluster.py) on a fresh L3, the same
conversations (``hicache bench multiturn``'s generator):

- ``single``: one ordinary ``hicache serve``, clients talk to it directly;
- ``pd``: one ``--disaggregation-mode prefill`` and one ``--disaggregation-mode
  decode`` instance (Mooncake TransferEngine between them) behind
  ``hicache router --pd-disaggregation`` (``--pd-decode-offload``: the decode
  instance backs finished requests' KV up to the L3, so the next turn's
  prefill finds it).

Reported side by side: TTFT and ITL (mean, p50, p99), throughput, failures.
Every instance has the same pools (``--max-total-tokens``, ``--hicache-ratio``).
On a CPU machine the pair shares the cores the single instance has alone and
pays the transfer on top: the figure is a record, not a win, until it runs on
separate devices. Results go to ``--out-dir``: ``pd_bench.md``,
``pd_bench.json``, each setup's request log and the clusters' logs under
``runs/<setup>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.bench.cluster import Cluster, ClusterConfig, ClusterError, L3Kind, RouterConfig
from hicache.bench.multiturn import (
    BenchmarkError,
    add_client_arguments,
    add_multiturn_arguments,
    args_config,
    multiturn_workload,
    prompt_maker,
    run_benchmark,
)
from hicache.bench.report import RunSummary, Stats
from hicache.bench.router_bench import DEFAULTS, SMOKE, SMOKE_L3_EXTRA, resolve_sizes
from hicache.bench.workload import WorkloadError
from hicache.testing.server_process import ServerStartError

SETUPS = ("single", "pd")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("setups")
    group.add_argument("--out-dir", required=True, help="where results and logs go")
    group.add_argument(
        "--setups", nargs="+", choices=SETUPS, default=list(SETUPS), metavar="SETUP",
        help="single (one instance) and/or pd (prefill + decode + PD router); "
        "default: %(default)s",
    )
    group.add_argument(
        "--worker-args", default=None,
        help="flags for every `hicache serve` (model, device, ...); default: none (SmolLM2); "
        f"--smoke: {SMOKE['worker_args']!r}",
    )
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help=f"each instance's L1 in tokens (default: "
                       f"{DEFAULTS['max_total_tokens']})")
    group.add_argument("--hicache-ratio", type=float, default=None,
                       help=f"each instance's L2 as a multiple of L1 (default: "
                       f"{DEFAULTS['hicache_ratio']:g})")
    group.add_argument("--pd-decode-offload", action="store_true",
                       help="the decode instance backs finished requests' KV up to the L3 "
                       "(--disaggregation-decode-enable-offload-kvcache)")
    group.add_argument("--router-args", default="",
                       help="more `hicache router` flags for the pd setup")
    group.add_argument("--startup-timeout", type=float, default=300.0,
                       help="seconds each server may take to come up (default: %(default)s)")
    group.add_argument("--smoke", action="store_true",
                       help="CPU-sized run: the tiny dummy model, a few short conversations")
    add_client_arguments(parser, url_required=False)
    add_multiturn_arguments(parser)
    parser.set_defaults(**dict.fromkeys(DEFAULTS))


@dataclass
class SetupRun:
    setup: str
    summary: RunSummary | None = None
    error: str | None = None


def cluster_config(args: argparse.Namespace, setup: str, run_dir: Path) -> ClusterConfig:
    pd = setup == "pd"
    return ClusterConfig(
        run_dir, num_workers=2 if pd else 1, worker_args=tuple(shlex.split(args.worker_args)),
        max_total_tokens=args.max_total_tokens, hicache_ratio=args.hicache_ratio,
        l3=L3Kind.FILE, l3_extra=dict(SMOKE_L3_EXTRA[L3Kind.FILE]) if args.smoke else {},
        kv_events=pd,  # the router's prefill choice reads them
        router=RouterConfig("cache_aware", tuple(shlex.split(args.router_args))) if pd
        else None,
        pd_decode_workers=1 if pd else 0, pd_decode_offload=pd and args.pd_decode_offload,
        startup_timeout_s=args.startup_timeout,
    )


def run_setup(setup: str, args: argparse.Namespace, out_dir: Path,
              config_json: dict[str, Any]) -> SetupRun:
    """A fresh cluster for ``setup``, the workload through it, everything stopped; a
    failure is recorded (the other setup still runs)."""
    run = SetupRun(setup)
    run_dir = out_dir / "runs" / setup
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        config = cluster_config(args, setup, run_dir)
        print(f"[{setup}] starting {config.num_workers} instance(s)", flush=True)
        with Cluster(config) as cluster:
            url = cluster.url if config.router is not None else cluster.workers[0].url
            run_args = argparse.Namespace(**vars(args))
            run_args.log_file = str(out_dir / f"{setup}.jsonl")
            sessions = multiturn_workload(args, prompt_maker(args))
            run.summary = asyncio.run(run_benchmark(
                run_args, sessions, prompt_maker(args), url, setup,
                {**config_json, "setup": setup},
            ))
    except (ClusterError, ServerStartError, BenchmarkError, WorkloadError, OSError) as error:
        run.error = str(error)
    finally:
        shutil.rmtree(run_dir / "l3", ignore_errors=True)
    return run


def _ms(stats: Stats | None, attr: str) -> str:
    return "-" if stats is None else f"{1000 * getattr(stats, attr):.1f}"


def results_table(runs: list[SetupRun]) -> str:
    lines = ["| setup | requests | failed | TTFT mean ms | p50 | p99 | ITL mean ms | p50 | p99 "
             "| output tok/s | note |", "|" + "---|" * 11]
    for run in runs:
        s = run.summary
        if s is None:
            lines.append(f"| {run.setup} | - | - | - | - | - | - | - | - | - | "
                         f"{(run.error or '').splitlines()[0] if run.error else ''} |")
            continue
        g = s.overall
        lines.append(
            f"| {run.setup} | {g.requests} | {g.failed} | {_ms(g.ttft_s, 'mean')} | "
            f"{_ms(g.ttft_s, 'p50')} | {_ms(g.ttft_s, 'p99')} | {_ms(g.itl_s, 'mean')} | "
            f"{_ms(g.itl_s, 'p50')} | {_ms(g.itl_s, 'p99')} | {s.output_throughput:.1f} | |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    resolve_sizes(args)
    if args.max_total_tokens < 1 or not args.hicache_ratio > 1:
        print("error: --max-total-tokens must be >= 1 and --hicache-ratio > 1", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.no_progress = args.no_progress or not sys.stderr.isatty()
    config_json = args_config(args)
    header = [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- workload: multiturn, {args.num_clients} clients x {args.num_rounds} rounds, first "
        f"prompt {args.request_length} tokens, +{args.sub_question_length} per round, output "
        f"{args.output_length}; max in flight {args.max_inflight or 'unlimited'}",
        f"- every instance: `hicache serve {args.worker_args or '(defaults)'}`, L1 "
        f"{args.max_total_tokens} tokens, L2 x{args.hicache_ratio:g}, file L3 (fresh per setup)",
        "- pd: 1 prefill + 1 decode instance, `hicache router --pd-disaggregation --policy "
        f"cache_aware {args.router_args}".rstrip() + "`"
        + (", decode offload to L3" if args.pd_decode_offload else ""),
        f"- CPUs: {os.cpu_count()} on the machine (the pd setup's two instances share them)",
    ]
    print("\n".join(header), flush=True)
    runs = [run_setup(setup, args, out_dir, config_json) for setup in args.setups]
    table = results_table(runs)
    md = out_dir / "pd_bench.md"
    md.write_text("# PD vs one instance\n\n" + "\n".join(header) + "\n\n" + table + "\n",
                  encoding="utf-8")
    (out_dir / "pd_bench.json").write_text(json.dumps(
        [{"setup": r.setup, "error": r.error,
          "summary": r.summary.to_json() if r.summary else None} for r in runs], indent=2),
        encoding="utf-8")
    print(table)
    print(f"wrote {md}")
    failed = any(r.error is not None or (r.summary and r.summary.overall.failed) for r in runs)
    return 1 if failed else 0
