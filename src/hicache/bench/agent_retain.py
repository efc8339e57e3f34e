"""``hicache bench agent-retain``: agent sessions that pause longer than the host tier keeps
them, with and without ``retain`` hints; the cache each gets back on resume.

One ``hicache serve`` worker per variant (a fresh one each), with no L3: what survives
a pause survives in L1 or L2, so the host tier's eviction order is what is measured.
``--sessions`` conversations take turns in order; after each session's turn come
``--fillers-per-pause`` unrelated prompts (other agents' traffic), so between two turns
of one session pass the other sessions' turns and ``sessions x fillers-per-pause``
fillers: more tokens than L1 + L2 hold (the plan says by how much), so without a hint
a session's pages are gone by its next turn.

- ``hints``: every session turn's body carries ``"hicache_hints": [{"kind": "retain",
  "ttl_s": --retain-ttl-s}]``: the worker keeps the session's prompt + answer above
  unretained pages in eviction order for that long (the fillers carry no hint);
- ``none``: the same requests without the field.

Reported per variant: the prompt tokens and the cached prompt tokens (by tier) of the
resumes (every session turn after its first: the first request after a pause), of the
first turns and of the fillers, and the hints' outcomes as the worker gave them; then
cached tokens on resume with hints over without (the target: >= 1.5x), from the raw
counts. A request that fails ends its variant (a session cannot go on without its
answer) and makes the command exit 1.
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
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.cache_tally import CacheTally, pct, ratio, times
from hicache.bench.client import ApiStyle, BenchClient, RequestResult
from hicache.bench.conversation_load import ConversationShape
from hicache.bench.report import RequestRecord, markdown_table
from hicache.bench.rolling_restart import MODEL_ARGS
from hicache.bench.workload import PromptMaker, WorkloadError
from hicache.testing.server_process import ServerProcess, ServerStartError

VARIANTS = ("none", "hints")
# Issue 33: with retain hints, cached tokens on resume >= 1.5x those without.
TARGET_RATIO = 1.5
TIERS = ("device", "host", "storage")
# Fillers draw from streams of their own, far from the sessions' numbers.
_FILLER_STREAM = 1 << 20


class AgentRetainError(RuntimeError):
    """The benchmark cannot run as configured."""


# ------------------------------------------------------------------------ flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    worker = parser.add_argument_group("worker")
    worker.add_argument("--out", default="agent_retain.json",
                        help="the JSON report (default: %(default)s)")
    worker.add_argument("--run-dir", default=None,
                        help="the workers' logs (default: the --out path with .runs)")
    worker.add_argument("--model", choices=sorted(MODEL_ARGS), default="smollm2",
                        help="smollm2: serve's default model; tiny: the tiny dummy model on "
                        "CPU, for smoke runs (default: %(default)s)")
    worker.add_argument("--worker-args", default="",
                        help="more flags for the `hicache serve` worker")
    worker.add_argument("--max-total-tokens", type=int, default=1024,
                        help="the device pool (L1) in tokens (default: %(default)s)")
    worker.add_argument("--hicache-ratio", type=float, default=4.0,
                        help="the host pool (L2) as a multiple of L1 (default: %(default)s)")
    worker.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds the worker may take to come up (default: %(default)s)")
    worker.add_argument("--variants", default=",".join(VARIANTS), metavar="VARIANT,VARIANT",
                        help=f"of {', '.join(VARIANTS)}, each on a fresh worker, in this "
                        "order (default: %(default)s)")
    load = parser.add_argument_group("sessions")
    load.add_argument("--sessions", type=int, default=4, help="default: %(default)s")
    load.add_argument("--turns", type=int, default=4, help="per session (default: %(default)s)")
    load.add_argument("--first-prompt-tokens", type=int, default=384,
                      help="default: %(default)s")
    load.add_argument("--turn-tokens", type=int, default=64,
                      help="tokens each later turn adds after the answer (default: "
                      "%(default)s)")
    load.add_argument("--output-tokens", type=int, default=16, help="default: %(default)s")
    load.add_argument("--fillers-per-pause", type=int, default=4,
                      help="unrelated prompts after each session turn (default: %(default)s)")
    load.add_argument("--filler-tokens", type=int, default=512,
                      help="tokens of each filler prompt (default: %(default)s)")
    load.add_argument("--retain-ttl-s", type=float, default=600.0,
                      help="the retain hints' ttl_s (default: %(default)s)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds per request (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Plan:
    variants: tuple[str, ...]
    shape: ConversationShape
    worker_args: tuple[str, ...]
    notes: tuple[str, ...]


def make_plan(args: argparse.Namespace) -> Plan:
    variants = tuple(v.strip() for v in args.variants.split(","))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise AgentRetainError(f"--variants: {', '.join(unknown) or '(none)'} is not one of "
                               f"{', '.join(VARIANTS)}")
    if args.sessions < 1 or args.turns < 2:
        raise AgentRetainError("--sessions must be >= 1 and --turns >= 2 (a resume needs a "
                               "turn before it)")
    if args.fillers_per_pause < 0 or args.filler_tokens < 1:
        raise AgentRetainError("--fillers-per-pause must be >= 0 and --filler-tokens >= 1")
    if args.max_total_tokens < 1 or not args.hicache_ratio > 1:
        raise AgentRetainError("--max-total-tokens must be >= 1 and --hicache-ratio > 1")
    if not args.retain_ttl_s > 0:
        raise AgentRetainError("--retain-ttl-s must be > 0")
    shape = ConversationShape(args.first_prompt_tokens, args.turn_tokens, args.output_tokens,
                              args.turns)
    worker_args = (
        *MODEL_ARGS[args.model], *shlex.split(args.worker_args),
        "--max-total-tokens", str(args.max_total_tokens),
        "--hicache-ratio", f"{args.hicache_ratio:g}",
        # No L3: only what L1 and L2 keep through a pause can be reused.
        "--hicache-storage-backend", "none",
    )
    l1 = args.max_total_tokens
    l2 = int(l1 * args.hicache_ratio)
    shape.check_fits(args.max_total_tokens, "--max-total-tokens")
    if args.filler_tokens + 1 > args.max_total_tokens:
        raise AgentRetainError("--filler-tokens must leave room for an answer within "
                               "--max-total-tokens")
    session_tokens = shape.longest_tokens
    pause = args.sessions * args.fillers_per_pause * args.filler_tokens
    notes = [
        f"L1 {l1} tokens, L2 {l2} tokens, no L3",
        f"sessions' contexts at their last turn: {args.sessions} x {session_tokens} = "
        f"{args.sessions * session_tokens} tokens ({args.sessions * session_tokens / l2:.2f}x L2)",
        f"filler tokens during one session's pause: {pause} ({pause / (l1 + l2):.2f}x L1 + L2)",
    ]
    if pause <= l1 + l2:
        notes.append("WARNING: L1 + L2 hold a whole pause's fillers; a session outlasts its "
                     "pause without hints too (raise --fillers-per-pause or --filler-tokens)")
    if args.sessions * session_tokens > l2:
        notes.append("WARNING: the sessions' contexts exceed L2: retain cannot keep them all")
    return Plan(variants, shape, worker_args, tuple(notes))


# ------------------------------------------------------------------------ one variant
@dataclass
class VariantRun:
    variant: str
    resumes: list[RequestRecord] = field(default_factory=list)
    first_turns: list[RequestRecord] = field(default_factory=list)
    fillers: list[RequestRecord] = field(default_factory=list)
    hint_outcomes: Counter[str] = field(default_factory=Counter)
    error: str | None = None

    @property
    def resume(self) -> CacheTally:
        return CacheTally.of(self.resumes)

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in (*self.resumes, *self.first_turns, *self.fillers))

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant, "error": self.error, "failed": self.failed,
            "resume": self.resume.to_json(),
            "first_turns": CacheTally.of(self.first_turns).to_json(),
            "fillers": CacheTally.of(self.fillers).to_json(),
            "hint_outcomes": dict(sorted(self.hint_outcomes.items())),
        }


def hints_body(variant: str, ttl_s: float) -> dict[str, Any] | None:
    """The extra body fields of a session turn (CONTRACT: a request's own hints)."""
    if variant != "hints":
        return None
    return {"hicache_hints": [{"kind": "retain", "ttl_s": ttl_s}]}


async def play(url: str, variant: str, args: argparse.Namespace, plan: Plan) -> VariantRun:
    """The sessions' turns in order, each followed by its fillers; stops at a failure."""
    run = VariantRun(variant)
    maker = PromptMaker()
    sessions = [plan.shape.session(n, maker, args.seed) for n in range(args.sessions)]
    filler_rng = np.random.default_rng([args.seed, _FILLER_STREAM])
    extra = hints_body(variant, args.retain_ttl_s)
    client = BenchClient(url, ApiStyle.GENERATE, timeout_s=args.request_timeout,
                         max_connections=1)
    start = time.perf_counter()  # the client's clock for sent_at
    async with client:
        for turn in range(args.turns):
            for session in sessions:
                request = session.next_request()
                result = await client.send(request.prompt, request.max_tokens, extra)
                record = _record(session.index, turn, result, start, maker.count(request.prompt))
                (run.resumes if turn else run.first_turns).append(record)
                for outcome in result.hints or ():
                    run.hint_outcomes[f"{outcome.get('kind')}/{outcome.get('outcome')}"] += 1
                if not result.ok:
                    run.error = f"session {session.index} turn {turn}: {result.error}"
                    return run
                session.record_answer(result.text, result.output_ids)
                for _ in range(args.fillers_per_pause):
                    prompt = maker.make(filler_rng, args.filler_tokens)
                    result = await client.send(prompt, 1)
                    run.fillers.append(_record(-1, turn, result, start, len(prompt)))
                    if not result.ok:
                        run.error = f"a filler after session {session.index}: {result.error}"
                        return run
    return run


def _record(session: int, turn: int, result: RequestResult, start: float,
            client_tokens: int) -> RequestRecord:
    return RequestRecord.of(session, turn, 0, result, start, client_tokens)


def run_variant(variant: str, args: argparse.Namespace, plan: Plan, run_dir: Path) -> VariantRun:
    """A fresh worker, the sessions against it, the worker stopped again."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    worker = ServerProcess(plan.worker_args, run_dir / "worker.log",
                           startup_timeout_s=args.startup_timeout, name=f"{variant} worker")
    print(f"[{variant}] starting the worker", flush=True)
    try:
        with worker:
            return asyncio.run(play(worker.url, variant, args, plan))
    except (ServerStartError, WorkloadError, OSError) as error:
        run = VariantRun(variant)
        run.error = f"{type(error).__name__}: {error}"
        return run


# ------------------------------------------------------------------------ report
def resume_ratio(runs: list[VariantRun]) -> float | None:
    """Cached tokens on resume with hints over without; None unless both ran clean."""
    by_name = {run.variant: run for run in runs}
    hints, none = by_name.get("hints"), by_name.get("none")
    if hints is None or none is None or hints.error or none.error:
        return None
    return ratio(hints.resume.cached_tokens, none.resume.cached_tokens)


def report_table(runs: list[VariantRun]) -> str:
    headers = ["variant", "failed", "resumes", "resume prompt", "resume cached",
               "cached share", "device/host", "hint outcomes"]
    rows = []
    for run in runs:
        resume = run.resume
        rows.append([
            run.variant, run.failed, resume.requests, resume.prompt_tokens,
            resume.cached_tokens, pct(resume.cached_share),
            f"{resume.cached_by_tier['device']}/{resume.cached_by_tier['host']}",
            " ".join(f"{k} {v}" for k, v in sorted(run.hint_outcomes.items())) or "-",
        ])
    return markdown_table(headers, rows)


def target_met(runs: list[VariantRun]) -> bool | None:
    """Cached tokens on resume with hints >= TARGET_RATIO x without (more than none at all
    when nothing was cached without); None unless both variants ran clean."""
    by_name = {run.variant: run for run in runs if run.error is None and run.failed == 0}
    if not {"hints", "none"} <= set(by_name):
        return None
    hints, none = by_name["hints"].resume.cached_tokens, by_name["none"].resume.cached_tokens
    return hints >= TARGET_RATIO * none and hints > 0


def _ratio_text(runs: list[VariantRun], resumed: float | None) -> str:
    """The ratio, or why there is none (without hints nothing was cached: unbounded)."""
    if resumed is not None:
        return times(resumed)
    clean = {run.variant: run for run in runs if run.error is None}
    if {"hints", "none"} <= set(clean) and clean["hints"].resume.cached_tokens:
        return f"unbounded ({clean['hints'].resume.cached_tokens} against 0)"
    return "-"


def main(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(args)
    except (AgentRetainError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    run_root = Path(args.run_dir) if args.run_dir else out.with_name(out.name + ".runs")
    config = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "cpus": os.cpu_count(), "model": args.model,
        "worker_args": list(plan.worker_args), "sessions": args.sessions, "turns": args.turns,
        "first_prompt_tokens": args.first_prompt_tokens, "turn_tokens": args.turn_tokens,
        "output_tokens": args.output_tokens, "fillers_per_pause": args.fillers_per_pause,
        "filler_tokens": args.filler_tokens, "retain_ttl_s": args.retain_ttl_s,
        "notes": list(plan.notes),
    }
    print("\n".join(f"- {note}" for note in plan.notes), flush=True)
    runs = []
    for variant in plan.variants:
        run = run_variant(variant, args, plan, run_root / variant)
        runs.append(run)
        print(f"[{variant}] {'ok' if run.error is None else 'FAILED: ' + run.error}", flush=True)
    resumed = resume_ratio(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": config, "variants": [run.to_json() for run in runs],
        "resume_cached_ratio": resumed, "target_ratio": TARGET_RATIO,
        "target_met": target_met(runs),
    }, indent=2) + "\n", encoding="utf-8")
    print(report_table(runs))
    met = {True: "met", False: "NOT met", None: "not measured"}[target_met(runs)]
    print(f"cached tokens on resume, hints / none: {_ratio_text(runs, resumed)} "
          f"(target >= {TARGET_RATIO:.2f}x: {met})")
    print(f"wrote {out}")
    return 0 if all(run.error is None and run.failed == 0 for run in runs) else 1
