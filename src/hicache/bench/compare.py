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
from hicache.bench.report import RunSummary, comparison_table, markdown_table, rounds_table
from hicache.bench.server_process import ServerProcess, ServerStartError
from hicache.bench.workload import Session, WorkloadError

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
SMOKE_SERVER_ARGS = (
    "--model-preset tiny --device cpu --max-total-tokens 1024 --page-size 16 "
    "--max-running-requests 8 --chunked-prefill-size 1024 "
    "--hicache-storage-prefetch-policy wait_complete"
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
    for module in ("mooncake.store", "hicache.storage.mooncake", "hicache.storage.mooncake_master"):
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
        from hicache.storage.mooncake_master import start_master

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
    """Fill the workload sizes not given on the command line: --smoke's, or else the
    defaults of the multiturn and long-context benchmarks."""
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


def _selected_configs(spec: str) -> list[ServerConfig]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown:
        raise CompareError(f"unknown --configs {unknown}; choose from {list(CONFIG_NAMES)}")
    return [c for c in CONFIGS if c.name in names]


def run_config(
    config: ServerConfig, args: argparse.Namespace, server_args: Sequence[str], out_dir: Path,
    workdir: Path, run_config_json: dict[str, Any], launcher: Sequence[str] | None = None,
) -> ConfigRun:
    """Start a fresh server for ``config``, run the workload, stop the server.

    Failures (the server does not start, the run breaks) are recorded in the
    result, not raised, so the other configurations still run.
    """
    run = ConfigRun(config)
    confdir = workdir / config.name
    confdir.mkdir(parents=True, exist_ok=True)
    # Keep every tier's files in this run's directory (also the default L3 path).
    env = {**os.environ, "HICACHE_CACHE_DIR": str(confdir / "cache")}
    log_path = out_dir / f"{config.name}.server.log"
    try:
        with _l3_args(config, confdir, _backend_extra(args, config.l3)) as l3_args:
            # The configuration's own flags go last, so they win over --server-args.
            flags = [*server_args, *config.args, *l3_args]
            server = ServerProcess(
                flags, log_path, env=env, startup_timeout_s=args.startup_timeout,
                launcher=launcher,
            )
            print(f"[{config.name}] starting: hicache serve {shlex.join(flags)}", flush=True)
            with server:
                if config.l3 is not None and "L3 storage NOT ATTACHED" in server.log_text():
                    run.notes.append(
                        f"L3 ({config.l3}) failed to attach; this run had no L3 "
                        f"(see {log_path.name})"
                    )
                # Fresh prompts each time: sessions hold per-run conversation state.
                sessions, _, _ = _workload(args)
                run_args = argparse.Namespace(**vars(args))
                run_args.log_file = str(out_dir / f"{config.name}.jsonl")
                config_json = {
                    **run_config_json, "config": config.name, "server_flags": flags,
                }
                run.summary = asyncio.run(run_benchmark(
                    run_args, sessions, prompt_maker(args), server.url, config.name, config_json,
                ))
            code = server.process.returncode if server.process is not None else None
            if code not in (0, None, -15):
                run.notes.append(f"server exited with status {code} (see {log_path.name})")
    except (CompareError, ServerStartError, BenchmarkError, OSError) as error:
        run.error = str(error)
    except Exception as error:  # an unexpected failure of one config must not stop the rest
        logger.exception("configuration %s failed", config.name)
        run.error = f"{type(error).__name__}: {error}"
    if run.summary is not None:
        run.summary.save(out_dir / f"{config.name}.json")
        if run.summary.overall.failed:
            run.notes.append(f"{run.summary.overall.failed} requests failed")
    return run


def write_report(
    runs: Sequence[ConfigRun], out_dir: Path, header: Sequence[str]
) -> tuple[Path, Path | None]:
    """comparison.md (and comparison.png when any run has results)."""
    summaries = [r.summary for r in runs if r.summary is not None]
    png: Path | None = None
    if summaries:
        png = plot_runs(summaries, out_dir / "comparison.png", "hicache bench compare")
    lines = ["# hicache bench compare", "", *header, ""]
    lines += ["## Results", "", comparison_table(summaries) if summaries else "(no results)", ""]
    if png is not None:
        lines += [f"![per-round TTFT and hit rate]({png.name})", ""]
    status_rows = [
        [r.config.name, r.config.description, "ok" if r.error is None else "FAILED",
         "; ".join([*([r.error.splitlines()[0]] if r.error else []), *r.notes]) or None]
        for r in runs
    ]
    status_table = markdown_table(["config", "tiers", "status", "notes"], status_rows)
    lines += ["## Runs", "", status_table, ""]
    for run in runs:
        if run.summary is not None and len(run.summary.rounds) > 1:
            lines += [f"### {run.config.name}: per round", "", rounds_table(run.summary), ""]
    for run in runs:
        if run.error is not None:
            lines += [f"### {run.config.name}: error", "", "```", run.error, "```", ""]
    md = out_dir / "comparison.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    (out_dir / "comparison.json").write_text(json.dumps({
        "runs": [
            {"config": r.config.name, "error": r.error, "notes": r.notes,
             "summary": None if r.summary is None else r.summary.to_json()}
            for r in runs
        ],
    }, indent=2) + "\n", encoding="utf-8")
    return md, png


def main(args: argparse.Namespace) -> int:
    resolve_sizes(args)
    server_text = args.server_args or (SMOKE_SERVER_ARGS if args.smoke else "")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        configs = _selected_configs(args.configs)
        for backend in ("file", "mooncake"):
            _backend_extra(args, backend)  # a bad JSON fails now, not after the other runs
        _, working_set, longest = _workload(args)
        server_args, size_notes = _size_device_pool(
            shlex.split(server_text), args.working_set_ratio, working_set, longest
        )
    except (CompareError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    skipped: list[str] = []
    if any(c.l3 == "mooncake" for c in configs):
        reason = mooncake_available()
        if reason is not None:
            skipped.append(f"l1-l2-l3-mooncake skipped: {reason}")
            configs = [c for c in configs if c.l3 != "mooncake"]
    args.no_progress = args.no_progress or not sys.stderr.isatty()
    config_json = args_config(args)
    config_json["working_set_tokens"] = working_set
    header = [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- workload: {args.workload} ({_workload_line(args)})",
        f"- api: {args.api}; request rate: {args.request_rate}; max in flight: "
        f"{args.max_inflight or 'unlimited'}; seed: {args.seed}",
        f"- server args (every config): `{shlex.join(server_args) or '(none)'}`",
        *(f"- {note}" for note in size_notes),
        *(f"- {note}" for note in skipped),
    ]
    print("\n".join(header), flush=True)
    runs: list[ConfigRun] = []
    with tempfile.TemporaryDirectory(prefix="hicache-compare-") as tmp:
        for config in configs:
            run = run_config(config, args, server_args, out_dir, Path(tmp), config_json)
            runs.append(run)
            status = "ok" if run.error is None else f"FAILED: {run.error.splitlines()[0]}"
            print(f"[{config.name}] {status}", flush=True)
    md, png = write_report(runs, out_dir, header)
    # The header went out before the runs; the rest of the report now.
    print("\n## Results" + md.read_text(encoding="utf-8").split("\n## Results", 1)[1])
    print(f"wrote {md}" + (f" and {png}" if png else ""))
    failed = any(r.error is not None or (r.summary and r.summary.overall.failed) for r in runs)
    return 1 if failed or not runs else 0


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

