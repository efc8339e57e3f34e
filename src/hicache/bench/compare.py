"""``hicache bench compare``: the same workload against each cache configuration, side by side.

For each configuration a fresh ``hicache serve`` process is started on a free
loopback port (with its own empty cache directory), the workload runs against
it, and the server is stopped, whatever happened. Configurations:

- ``no-cache``: no prefix cache at all (the baseline of every ratio);
- ``l1``: device prefix cache only;
- ``l1-l2``: device + host memory;
- ``l1-l2-l3-file``: device + host + the file backend in a fresh directory;
- ``l1-l2-l3-mooncake``: device + host + Mooncake, when the ``mooncake`` module and the
  project's local-master helper are importable (a master is started on loopback for
  the run).

``--server-args`` are passed to every server (model preset, --max-total-tokens,
--device, ...). ``--working-set-ratio K`` sizes the device pool to the workload:
``--max-total-tokens`` = working set / K, so the conversations' KV exceeds the
device pool K times over, which is where the host and storage tiers earn their
keep. ``--file-extra-config`` / ``--mooncake-extra-config`` add backend settings
(e.g. a larger ``max_bytes`` for the file backend when the working set is big).
Results land in ``--out-dir``: one summary JSON, request log and server
log per configuration, ``comparison.md`` (markdown tables) and ``comparison.png``.
``--smoke`` is a CPU-sized run (tiny model, a few short conversations) for CI.

``--baseline-command`` adds an external OpenAI-compatible server (vLLM's CPU
build, say) as one more run: started from the user's shell line (see
baseline.py), driven through ``/v1/completions``, and stopped with its whole
process group. It is asked for its output token ids (vLLM's ``return_token_ids``),
so that on both sides (hicache through ``/generate``) each round's prompt holds
the server's own answer tokens (the two sides send the same prompts when the
model answers alike) and TTFT is the time to the first streamed chunk that
carries an output token. With a baseline every configuration runs ``--repeats``
times (default 2), alternating with the baseline; the report adds every run in order
with the load average before and after it, aggregates over the repeats and the
ratios hicache / baseline (see aggregate.py). ``--cpus N`` pins every server to
N CPUs (see hicache/testing/cpu_limit.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.aggregate import (
    LoadAverage,
    RunResult,
    aggregates,
    aggregates_table,
    ratios,
    ratios_table,
    runs_table,
    workload_mismatches,
)
from hicache.bench.background_load import busy_cores
from hicache.bench.baseline import BaselineError, BaselineServer, check_template, model_path_of
from hicache.bench.client import ApiStyle
from hicache.bench.long_context import add_long_context_arguments, long_context_workload
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
from hicache.bench.plots import plot_runs
from hicache.bench.report import (
    RequestRecord,
    RunSummary,
    comparison_table,
    markdown_table,
    read_jsonl,
    rounds_table,
)
from hicache.bench.workload import Session, WorkloadError
from hicache.testing.cpu_limit import CpuLimit, CpuLimitError
from hicache.testing.server_process import ChildServer, ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

_NO_L3 = ("--hicache-storage-backend", "none")
_EXTRA_CONFIG = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    description: str
    args: tuple[str, ...]
    l3: str | None = None  # the L3 backend this configuration attaches


CONFIGS: tuple[ServerConfig, ...] = (
    ServerConfig(
        "no-cache", "no prefix cache",
        ("--disable-radix-cache", "--disable-hierarchical-cache", *_NO_L3),
    ),
    ServerConfig("l1", "device (L1) prefix cache", ("--disable-hierarchical-cache", *_NO_L3)),
    ServerConfig("l1-l2", "L1 + host memory (L2)", _NO_L3),
    ServerConfig(
        "l1-l2-l3-file", "L1 + L2 + file storage (L3)",
        ("--hicache-storage-backend", "file"), l3="file",
    ),
    ServerConfig(
        "l1-l2-l3-mooncake", "L1 + L2 + Mooncake storage (L3)",
        ("--hicache-storage-backend", "mooncake"), l3="mooncake",
    ),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)

# What --smoke runs: the tiny model on CPU; 8 conversations of ~460 tokens (3.6x the device
# pool, 1.8x the host pool) visited in turn, so L1 and L2 lose each one before its next round
# and only L3 can serve it. wait_complete: an idle CPU server schedules a request before a
# best-effort L3 prefetch lands, and the smoke run should show L3 hits.
# L1 1024 tokens and L2 1.25x that: the smoke workload's eight conversations (~420 tokens
# each by round 2) pass ~2.9K tokens through between two visits to one of them, well past
# L1 + L2, so its later rounds can only come from L3 (at L2 = 2x L1 the two were within 5%
# of each other and the tier a prefix came back from depended on the timing). Whether L3
# has them yet still races the writes: on a busy machine round 1 may find none there.
# --hicache-reuse-policy load: the smoke run shows the tiers serving; on the tiny model a
# prompt computes in about the time its pages take to read, so the cost policy's choice
# between the two would follow the machine's load.
SMOKE_SERVER_ARGS = (
    "--model-preset tiny --device cpu --max-total-tokens 1024 --page-size 16 "
    "--max-running-requests 8 --chunked-prefill-size 1024 --hicache-ratio 1.25 "
    "--hicache-storage-prefetch-policy wait_complete --hicache-reuse-policy load"
)
SMOKE_WORKLOAD = {
    "num_clients": 8, "num_rounds": 3, "request_length": 384, "sub_question_length": 32,
    "output_length": 4, "max_inflight": 4, "num_contexts": 3, "context_length": 384,
    "questions_per_context": 3, "question_length": 16, "warmup": 1,
}

SMOKE_MOONCAKE = {"global_segment_size": "64MiB", "local_buffer_size": "16MiB"}


class CompareError(RuntimeError):
    """The comparison cannot run as configured."""


def mooncake_available() -> str | None:
    """None when the Mooncake configuration can run here, else why it cannot."""
    for module in (
        "mooncake.store", "hicache.storage.backends.mooncake.backend",
        "hicache.testing.mooncake_master",
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"module {module} is not available"
    return None


@contextlib.contextmanager
def _l3_args(
    config: ServerConfig, workdir: Path, extra: dict[str, Any]
) -> Iterator[list[str]]:
    """The flags that give ``config`` a fresh L3 (and whatever that needs running)."""
    if config.l3 == "file":
        yield [_EXTRA_CONFIG, json.dumps({**extra, "path": str(workdir / "l3")})]
    elif config.l3 == "mooncake":
        from hicache.testing.mooncake_master import start_master

        with start_master() as master:
            yield [_EXTRA_CONFIG, json.dumps({**extra, "master_server_address": master.address})]
    else:
        yield []


# ------------------------------------------------------------------------ flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("comparison")
    group.add_argument("--out-dir", required=True, help="where results, logs and plots go")
    group.add_argument(
        "--configs", default=",".join(CONFIG_NAMES),
        help="comma-separated subset of: " + ", ".join(CONFIG_NAMES) + " (default: all; "
        "mooncake is skipped when unavailable)",
    )
    group.add_argument(
        "--server-args", default="",
        help='flags for every `hicache serve`, e.g. "--model-preset llama3-8b --device cuda"',
    )
    group.add_argument(
        "--working-set-ratio", type=float, default=None, metavar="K",
        help="size the device pool to the workload's working set / K (adds --max-total-tokens)",
    )
    group.add_argument(
        "--workload", choices=["multiturn", "long-context"], default="multiturn",
        help="which client benchmark to run against each server (default: %(default)s)",
    )
    group.add_argument(
        "--file-extra-config", default=None, metavar="JSON",
        help="more extra-config keys for the file L3 run (its fresh path is filled in), "
        'e.g. \'{"max_bytes": "200GB", "prefetch_threshold": 64}\'',
    )
    group.add_argument(
        "--mooncake-extra-config", default=None, metavar="JSON",
        help="more extra-config keys for the Mooncake run (its master address is filled in), "
        'e.g. \'{"global_segment_size": "16GiB"}\'',
    )
    group.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    group.add_argument(
        "--smoke", action="store_true",
        help=f"CPU-sized run for CI: server args {SMOKE_SERVER_ARGS!r} and a few short "
        "conversations (explicit flags still win)",
    )
    baseline = parser.add_argument_group("external baseline server")
    baseline.add_argument(
        "--baseline-command", default=None, metavar="SHELL_LINE",
        help="start an OpenAI-compatible baseline server with this shell line; {port} "
        "(required), {host} and {model} are filled in, e.g. 'python -m "
        "vllm.entrypoints.openai.api_server --model {model} --host {host} --port {port}'",
    )
    baseline.add_argument(
        "--baseline-name", default="baseline", help="the baseline's name in the report "
        "(default: %(default)s)",
    )
    baseline.add_argument(
        "--baseline-model", default=None,
        help="what {model} becomes (default: the --model-path in --server-args)",
    )
    baseline.add_argument(
        "--baseline-api", choices=[a.value for a in ApiStyle], default=ApiStyle.OPENAI.value,
        help="the API the baseline is driven through (default: %(default)s: /v1/completions)",
    )
    baseline.add_argument(
        "--no-baseline-token-ids", dest="baseline_token_ids", action="store_false",
        help="do not ask the baseline for its output token ids (return_token_ids, a vLLM "
        "extension of /v1/completions) for servers that refuse it; its answers are then "
        "re-encoded from their text, which can change the next rounds' prompts",
    )
    baseline.add_argument(
        "--repeats", type=int, default=None, metavar="N",
        help="run every configuration (and the baseline) N times, alternating "
        "(default: 2 with --baseline-command, else 1)",
    )
    baseline.add_argument(
        "--cpus", type=int, default=None, metavar="N",
        help="pin every server (hicache and baseline) to the first N CPUs this process may "
        "use: taskset -c, and OMP/MKL/OPENBLAS_NUM_THREADS=N and VLLM_CPU_OMP_THREADS_BIND "
        "in their environment; the client moves to the other CPUs when there are any",
    )
    baseline.add_argument(
        "--background-load", type=int, default=0, metavar="N",
        help="keep N other processes spinning on the CPU during every run (hicache's and "
        "the baseline's alike): how each side holds up on a busy machine (default: 0)",
    )
    add_client_arguments(parser, url_required=False)
    add_multiturn_arguments(parser)
    add_long_context_arguments(parser, output_length=False)
    # Defaults stay None so --smoke can tell which sizes were given explicitly.
    parser.set_defaults(**dict.fromkeys(SMOKE_WORKLOAD))


def _backend_extra(args: argparse.Namespace, backend: str | None) -> dict[str, Any]:
    """The user's extra-config keys for an L3 backend (--file/--mooncake-extra-config)."""
    if backend is None:
        return {}
    text = getattr(args, f"{backend}_extra_config")
    if text:
        try:
            extra = json.loads(text)
        except ValueError as error:
            raise CompareError(f"--{backend}-extra-config is not JSON: {error}") from error
        if not isinstance(extra, dict):
            raise CompareError(f"--{backend}-extra-config must be a JSON object")
        return extra
    # The smoke run lends Mooncake a small segment: it holds a few pages of a tiny model.
    return dict(SMOKE_MOONCAKE) if args.smoke and backend == "mooncake" else {}


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the flags not given on the command line whose defaults depend on others.

    Workload sizes: --smoke's, or else the defaults of the multiturn and long-context
    benchmarks. --repeats: 2 with a baseline, else 1.
    """
    if getattr(args, "repeats", None) is None:
        args.repeats = 2 if getattr(args, "baseline_command", None) is not None else 1
    if args.smoke:
        defaults = SMOKE_WORKLOAD
    else:
        parser = argparse.ArgumentParser(add_help=False)
        add_client_arguments(parser, url_required=False)
        add_multiturn_arguments(parser)
        add_long_context_arguments(parser, output_length=False)
        defaults = {key: parser.get_default(key) for key in SMOKE_WORKLOAD}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _pool_flags(server_args: Sequence[str]) -> argparse.Namespace:
    """The pool-size flags among ``server_args`` (unknown flags are ignored)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--hicache-ratio", type=float, default=2.0)
    parser.add_argument("--hicache-size", type=float, default=0.0)
    known, _ = parser.parse_known_args(list(server_args))
    return known


def _workload(args: argparse.Namespace) -> tuple[list[Session], int | None, int]:
    """The sessions, their working set in tokens (if known) and the longest request."""
    maker = prompt_maker(args)
    if args.workload == "multiturn":
        sessions = multiturn_workload(args, maker)
        working_set: int | None = multiturn_working_set(args)
        longest = (
            args.request_length
            + (args.num_rounds - 1) * (args.output_length + args.sub_question_length)
            + args.output_length
        )
    else:
        sessions = long_context_workload(args, maker)
        contexts = {s.group: maker.count(s.parts[0]) for s in sessions}
        working_set = sum(contexts.values()) if contexts else None
        longest = max(maker.count(s.parts[0]) + s.max_tokens for s in sessions)
    return sessions, working_set, longest


def _size_device_pool(
    server_args: list[str], ratio: float | None, working_set: int | None, longest: int
) -> tuple[list[str], list[str]]:
    """Server args with --max-total-tokens set from the ratio; lines describing the sizes."""
    notes: list[str] = []
    flags = _pool_flags(server_args)
    if ratio is not None:
        if not ratio > 0:
            raise CompareError("--working-set-ratio must be > 0")
        if working_set is None:
            raise CompareError("--working-set-ratio: the workload's working set is unknown")
        if flags.max_total_tokens is not None:
            raise CompareError("give --working-set-ratio or --max-total-tokens, not both")
        pool = int(working_set / ratio)
        # A request must fit the device pool with room for its last partial page.
        floor = longest + 256
        if pool < floor:
            raise CompareError(
                f"--working-set-ratio {ratio}: a device pool of {pool} tokens cannot hold the "
                f"longest request ({longest} tokens); use a smaller ratio or more clients"
            )
        server_args = [*server_args, "--max-total-tokens", str(pool)]
        flags.max_total_tokens = pool
    if working_set is not None:
        notes.append(f"working set: {working_set} tokens (what a cache of every prefix holds)")
    if flags.max_total_tokens is not None:
        device = flags.max_total_tokens
        notes.append(f"device pool (L1): {device} tokens")
        if working_set is not None:
            notes.append(f"working set / device pool: {working_set / device:.2f}x")
        if flags.hicache_size == 0:
            host = device * flags.hicache_ratio
            notes.append(
                f"host pool (L2, --hicache-ratio {flags.hicache_ratio:g}): {host:.0f} tokens"
            )
            if working_set is not None:
                notes.append(f"working set / host pool: {working_set / host:.2f}x")
    return server_args, notes


# ------------------------------------------------------------------------ driver
@dataclass
class ConfigRun:
    config: ServerConfig
    summary: RunSummary | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    # The run's label and the stem of its files: the config's name, ".N" added when repeated.
    stem: str = ""
    repeat: int = 1
    baseline: bool = False  # the external baseline server, not a hicache configuration
    # os.getloadavg() when the workload started (the server ready: its start-up, vLLM's
    # compilation say, is not the run's) and when it ended.
    load_before: LoadAverage | None = None
    load_after: LoadAverage | None = None
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.stem:
            self.stem = self.config.name

    def result(self) -> RunResult | None:
        if self.summary is None:
            return None
        return RunResult(
            self.config.name, self.repeat, self.summary, self.records, self.load_before,
            self.load_after,
        )


def _selected_configs(spec: str) -> list[ServerConfig]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown:
        raise CompareError(f"unknown --configs {unknown}; choose from {list(CONFIG_NAMES)}")
    return [c for c in CONFIGS if c.name in names]


@contextlib.contextmanager
def _recorded(run: ConfigRun) -> Iterator[None]:
    """Record the block's failure in ``run`` (not raised: the other runs still go), and
    the load average where the workload did not get to record it."""
    try:
        yield
    except (
        CompareError, ServerStartError, BenchmarkError, BaselineError, CpuLimitError, OSError
    ) as error:
        run.error = str(error)
    except Exception as error:  # an unexpected failure of one run must not stop the rest
        logger.exception("run %s failed", run.stem)
        run.error = f"{type(error).__name__}: {error}"
    finally:
        now = os.getloadavg()
        run.load_before = run.load_before or now
        run.load_after = run.load_after or now


def _drive(
    run: ConfigRun, server: ChildServer, args: argparse.Namespace, out_dir: Path,
    config_json: dict[str, Any], **overrides: Any,
) -> None:
    """Run the workload against a ready server; ``overrides`` replace flags (api, model)."""
    # Fresh prompts each time: sessions hold per-run conversation state.
    sessions, _, _ = _workload(args)
    run_args = argparse.Namespace(**{**vars(args), **overrides})
    run_args.log_file = str(out_dir / f"{run.stem}.jsonl")
    run.load_before = os.getloadavg()
    try:
        run.summary = asyncio.run(run_benchmark(
            run_args, sessions, prompt_maker(args), server.url, run.stem, config_json,
        ))
    finally:
        run.load_after = os.getloadavg()
    run.records = read_jsonl(run_args.log_file)


def _finish(run: ConfigRun, out_dir: Path) -> ConfigRun:
    if run.summary is not None:
        run.summary.save(out_dir / f"{run.stem}.json")
        if run.summary.overall.failed:
            run.notes.append(f"{run.summary.overall.failed} requests failed")
    return run


def run_config(
    config: ServerConfig, args: argparse.Namespace, server_args: Sequence[str], out_dir: Path,
    workdir: Path, run_config_json: dict[str, Any], launcher: Sequence[str] | None = None,
    *, stem: str = "", repeat: int = 1, cpu_limit: CpuLimit | None = None,
) -> ConfigRun:
    """Start a fresh server for ``config``, run the workload, stop the server.

    Failures (the server does not start, the run breaks) are recorded in the
    result, not raised, so the other configurations still run.
    """
    run = ConfigRun(config, stem=stem, repeat=repeat)
    confdir = workdir / run.stem
    confdir.mkdir(parents=True, exist_ok=True)
    # Keep every tier's files in this run's directory (also the default L3 path).
    env = {**os.environ, "HICACHE_CACHE_DIR": str(confdir / "cache")}
    log_path = out_dir / f"{run.stem}.server.log"
    with _recorded(run), _l3_args(config, confdir, _backend_extra(args, config.l3)) as l3_args:
        # The configuration's own flags go last, so they win over --server-args.
        flags = [*server_args, *config.args, *l3_args]
        server = ServerProcess(
            flags, log_path, env=env, startup_timeout_s=args.startup_timeout,
            launcher=launcher, cpu_limit=cpu_limit,
        )
        pinned = f" (on CPU {cpu_limit.cpu_list})" if cpu_limit is not None else ""
        print(f"[{run.stem}] starting: hicache serve {shlex.join(flags)}{pinned}", flush=True)
        with server:
            if config.l3 is not None and "L3 storage NOT ATTACHED" in server.log_text():
                run.notes.append(
                    f"L3 ({config.l3}) failed to attach; this run had no L3 "
                    f"(see {log_path.name})"
                )
            config_json = {**run_config_json, "config": config.name, "server_flags": flags}
            _drive(run, server, args, out_dir, config_json)
        code = server.process.returncode if server.process is not None else None
        if code not in (0, None, -15):
            run.notes.append(f"server exited with status {code} (see {log_path.name})")
    return _finish(run, out_dir)


def run_baseline(
    args: argparse.Namespace, out_dir: Path, run_config_json: dict[str, Any], *,
    model: str | None, stem: str = "", repeat: int = 1, cpu_limit: CpuLimit | None = None,
) -> ConfigRun:
    """Start the external baseline from ``--baseline-command``, run the workload through
    ``--baseline-api``, stop it with its process group. Failures are recorded, not raised."""
    name = args.baseline_name
    config = ServerConfig(name, "external baseline (--baseline-command)", ())
    run = ConfigRun(config, stem=stem, repeat=repeat, baseline=True)
    log_path = out_dir / f"{run.stem}.server.log"
    with _recorded(run):
        server = BaselineServer(
            args.baseline_command, log_path, name=name, model=model,
            startup_timeout_s=args.startup_timeout, cpu_limit=cpu_limit,
        )
        print(f"[{run.stem}] starting: {shlex.join(server.command)}", flush=True)
        with server:
            config_json = {
                **run_config_json, "config": name, "baseline_command": server.shell_command,
                "server_command": server.command, "api": args.baseline_api,
            }
            # The model name comes from the baseline's /v1/models; /flush_cache is not an
            # OpenAI route (and a fresh server has nothing cached anyway).
            _drive(
                run, server, args, out_dir, config_json, api=args.baseline_api, model=None,
                flush_cache=False, return_token_ids=args.baseline_token_ids,
            )
            if server.process is not None and server.process.poll() is not None:
                run.notes.append(
                    f"the baseline exited (status {server.process.returncode}) before it was "
                    f"stopped (see {log_path.name})"
                )
    return _finish(run, out_dir)


def write_report(
    runs: Sequence[ConfigRun], out_dir: Path, header: Sequence[str]
) -> tuple[Path, Path | None]:
    """comparison.md and comparison.json (and comparison.png when any run has results)."""
    summaries = [r.summary for r in runs if r.summary is not None]
    results = [res for r in runs if (res := r.result()) is not None]
    png: Path | None = None
    if summaries:
        png = plot_runs(summaries, out_dir / "comparison.png", "hicache bench compare")
    lines = ["# hicache bench compare", "", *header, ""]
    lines += ["## Results", "", comparison_table(summaries) if summaries else "(no results)", ""]
    if png is not None:
        lines += [f"![per-round TTFT and hit rate]({png.name})", ""]
    baseline = next((r.config.name for r in runs if r.baseline), None)
    repeated = any(r.repeat > 1 for r in runs)
    aggs = aggregates(results)
    hicache_names = list(dict.fromkeys(r.config.name for r in runs if not r.baseline))
    ratio_rows = ratios(results, baseline, hicache_names) if baseline is not None else []
    mismatches = workload_mismatches(aggs, baseline) if baseline is not None else []
    if baseline is not None or repeated:
        lines += [
            "## Runs in order", "",
            "Load average (1/5/15 min) of the machine when the workload started (the server "
            "ready) and when it ended.", "",
            runs_table(results) if results else "(no results)", "",
            "## Aggregated over repeats", "",
            "Throughput: all runs' tokens over the sum of their durations; TTFT: over all "
            "their requests. Total = prompt (cached included) + output tokens.", "",
            aggregates_table(aggs) if aggs else "(no results)", "",
        ]
    if baseline is not None:
        lines += [
            f"## hicache / {baseline}", "",
            "Ratios of the aggregates above (throughput: > 1 means hicache is faster; TTFT: "
            "< 1 means hicache answers sooner); per repeat: run i of each side, which ran "
            "next to each other.", "",
            ratios_table(ratio_rows) if ratio_rows else "(no ratios: a side has no results)", "",
            *(line for w in mismatches for line in (f"WARNING: {w}", "")),
        ]
    status_rows = [
        [r.stem, r.config.description, "ok" if r.error is None else "FAILED",
         "; ".join([*([r.error.splitlines()[0]] if r.error else []), *r.notes]) or None]
        for r in runs
    ]
    status_table = markdown_table(["config", "tiers", "status", "notes"], status_rows)
    lines += ["## Runs", "", status_table, ""]
    for run in runs:
        if run.summary is not None and len(run.summary.rounds) > 1:
            lines += [f"### {run.stem}: per round", "", rounds_table(run.summary), ""]
    for run in runs:
        if run.error is not None:
            lines += [f"### {run.stem}: error", "", "```", run.error, "```", ""]
    md = out_dir / "comparison.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    (out_dir / "comparison.json").write_text(json.dumps({
        "runs": [
            {"config": r.config.name, "run": r.stem, "repeat": r.repeat,
             "baseline": r.baseline, "load_before": r.load_before, "load_after": r.load_after,
             "error": r.error, "notes": r.notes,
             "summary": None if r.summary is None else r.summary.to_json()}
            for r in runs
        ],
        "aggregates": [a.to_json() for a in aggs],
        "ratios": [r.to_json() for r in ratio_rows],
        "warnings": mismatches,
    }, indent=2) + "\n", encoding="utf-8")
    return md, png


@dataclass(frozen=True)
class _Plan:
    """What main runs, checked before any server starts."""

    configs: list[ServerConfig]
    server_args: list[str]
    notes: list[str]
    working_set: int | None
    cpu_limit: CpuLimit | None
    baseline_model: str | None


def _plan(args: argparse.Namespace, server_text: str) -> _Plan:
    configs = _selected_configs(args.configs)
    for backend in ("file", "mooncake"):
        _backend_extra(args, backend)  # a bad JSON fails now, not after the other runs
    _, working_set, longest = _workload(args)
    server_args, notes = _size_device_pool(
        shlex.split(server_text), args.working_set_ratio, working_set, longest
    )
    if args.repeats < 1:
        raise CompareError("--repeats must be >= 1")
    cpu_limit = CpuLimit.first(args.cpus) if args.cpus is not None else None
    model = None
    if args.baseline_command is not None:
        if args.baseline_name in CONFIG_NAMES or not args.baseline_name.strip():
            raise CompareError(
                f"--baseline-name {args.baseline_name!r} must be a new name (not empty, not "
                f"one of {list(CONFIG_NAMES)})"
            )
        model = args.baseline_model or model_path_of(server_args)
        check_template(args.baseline_command, model)
    return _Plan(configs, server_args, notes, working_set, cpu_limit, model)


def _baseline_lines(args: argparse.Namespace, plan: _Plan) -> list[str]:
    if args.baseline_command is None:
        return []
    name = args.baseline_name
    lines = [
        f"- baseline: {name}: `{args.baseline_command}`"
        + (f" with {{model}} = `{plan.baseline_model}`" if plan.baseline_model else ""),
        f"- api: hicache {args.api}, {name} {args.baseline_api}"
        + (" with return_token_ids" if _baseline_ids(args) else ""),
    ]
    hicache_ids = args.api == ApiStyle.GENERATE.value
    if hicache_ids and _baseline_ids(args):
        lines.append(
            "- both sides return their output token ids: each round's prompt holds the "
            "server's own answer tokens, and TTFT is the time to the first streamed chunk "
            "carrying an output token on both"
        )
    else:
        side = "hicache's" if not hicache_ids else f"{name}'s"
        lines.append(
            f"- WARNING: {side} answers are re-encoded from their text for the next round "
            "(its API returns no token ids), so the two sides' prompts can differ (compare "
            "their prompt tokens), and its TTFT counts the first chunk with text"
        )
    return lines


def _baseline_ids(args: argparse.Namespace) -> bool:
    return bool(args.baseline_api == ApiStyle.GENERATE.value or args.baseline_token_ids)


def main(args: argparse.Namespace) -> int:
    resolve_sizes(args)
    server_text = args.server_args or (SMOKE_SERVER_ARGS if args.smoke else "")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        plan = _plan(args, server_text)
    except (CompareError, WorkloadError, BaselineError, CpuLimitError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    configs = plan.configs
    skipped: list[str] = []
    if any(c.l3 == "mooncake" for c in configs):
        reason = mooncake_available()
        if reason is not None:
            skipped.append(f"l1-l2-l3-mooncake skipped: {reason}")
            configs = [c for c in configs if c.l3 != "mooncake"]
    args.no_progress = args.no_progress or not sys.stderr.isatty()
    config_json = args_config(args)
    config_json["working_set_tokens"] = plan.working_set
    header = [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- workload: {args.workload} ({_workload_line(args)})",
        f"- api: {args.api}; request rate: {args.request_rate}; max in flight: "
        f"{args.max_inflight or 'unlimited'}; seed: {args.seed}",
        f"- server args (every config): `{shlex.join(plan.server_args) or '(none)'}`",
        *(f"- {note}" for note in plan.notes),
        *(f"- {note}" for note in skipped),
        *_baseline_lines(args, plan),
        f"- repeats: {args.repeats}" + (
            " (alternating: every configuration, then the baseline, then again)"
            if args.baseline_command is not None else ""
        ),
        f"- CPUs: {plan.cpu_limit.describe() if plan.cpu_limit else 'not limited'}; "
        f"{os.cpu_count()} on the machine; background load: "
        f"{args.background_load} spinning processes during every run",
    ]
    print("\n".join(header), flush=True)
    runs = _run_all(args, configs, plan, out_dir, config_json)
    md, png = write_report(runs, out_dir, header)
    # The header went out before the runs; the rest of the report now.
    print("\n## Results" + md.read_text(encoding="utf-8").split("\n## Results", 1)[1])
    print(f"wrote {md}" + (f" and {png}" if png else ""))
    failed = any(r.error is not None or (r.summary and r.summary.overall.failed) for r in runs)
    return 1 if failed or not runs else 0


def _run_all(
    args: argparse.Namespace, configs: Sequence[ServerConfig], plan: _Plan, out_dir: Path,
    config_json: dict[str, Any],
) -> list[ConfigRun]:
    """Every configuration, then the baseline, --repeats times over."""
    runs: list[ConfigRun] = []
    cpu = plan.cpu_limit
    with tempfile.TemporaryDirectory(prefix="hicache-compare-") as tmp, (
        cpu.client_elsewhere() if cpu is not None else contextlib.nullcontext()
    ):
        for repeat in range(1, args.repeats + 1):
            suffix = f".{repeat}" if args.repeats > 1 else ""
            for config in configs:
                with busy_cores(args.background_load):
                    runs.append(run_config(
                        config, args, plan.server_args, out_dir, Path(tmp), config_json,
                        stem=config.name + suffix, repeat=repeat, cpu_limit=cpu,
                    ))
                _print_status(runs[-1])
            if args.baseline_command is not None:
                with busy_cores(args.background_load):
                    runs.append(run_baseline(
                        args, out_dir, config_json, model=plan.baseline_model,
                        stem=args.baseline_name + suffix, repeat=repeat, cpu_limit=cpu,
                    ))
                _print_status(runs[-1])
    return runs


def _print_status(run: ConfigRun) -> None:
    status = "ok" if run.error is None else f"FAILED: {run.error.splitlines()[0]}"
    load = ""
    if run.load_before is not None and run.load_after is not None:
        load = f" (load average {run.load_before[0]:.2f} -> {run.load_after[0]:.2f})"
    print(f"[{run.stem}] {status}{load}", flush=True)


def _workload_line(args: argparse.Namespace) -> str:
    if args.workload == "multiturn":
        return (
            f"{args.num_clients} clients x {args.num_rounds} rounds, first prompt "
            f"{args.request_length} tokens, +{args.sub_question_length} per round, "
            f"output {args.output_length}"
        )
    if args.dataset:
        return f"dataset {args.dataset}, output {args.output_length}"
    return (
        f"{args.num_contexts} contexts x {args.context_length} tokens, "
        f"{args.questions_per_context} questions of {args.question_length} tokens each, "
        f"output {args.output_length}"
    )
