"""``hicache bench multiturn``: many clients holding multi-round conversations with a server.

Each of ``--num-clients`` clients opens with a prompt of ``--request-length``
tokens; every later round sends the whole conversation so far (previous prompt,
the server's answer, a new sub-question of ``--sub-question-length`` tokens), so
a server with prefix caching can reuse everything but the newest part. A round
is sent only once the client's previous round has finished; sends are spaced by
Poisson or uniform gaps for ``--request-rate`` requests per second (default: no
spacing), at most ``--max-inflight`` at a time, and with ``--round-barrier``
nobody starts round r+1 before everybody finished round r.

This module also holds what the other client benchmarks share: the client and
pacing flags (``add_client_arguments``) and the runner (``run_sessions``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from hicache.bench.client import ApiStyle, BenchClient
from hicache.bench.report import JsonlLog, RequestRecord, RunSummary, format_summary
from hicache.bench.workload import (
    ArrivalDistribution,
    PromptMaker,
    PromptStyle,
    Session,
    WorkloadError,
    arrival_gaps,
    load_codec,
    multiturn_sessions,
    warmup_prompts,
    working_set_tokens,
)


class BenchmarkError(RuntimeError):
    """The benchmark could not run (server unreachable, warm-up failed)."""


# ------------------------------------------------------------------------ flags
def add_client_arguments(parser: argparse.ArgumentParser, *, url_required: bool = True) -> None:
    """Server, API, pacing, prompt and output flags common to the client benchmarks.

    SGLang's bench_multiturn.py flag names are accepted too (``--host/--port``,
    ``--api-format``, ``--max-parallel``, ...), so its command lines run here unchanged.
    """
    server = parser.add_argument_group("server")
    if url_required:
        server.add_argument(
            "--url", default=None,
            help="server base URL, e.g. http://127.0.0.1:30000 (default: from --host/--port)",
        )
        server.add_argument("--host", default="127.0.0.1", help="server host (default: 127.0.0.1)")
        server.add_argument("--port", type=int, default=30000, help="server port (default: 30000)")
    server.add_argument(
        "--api", "--api-format", dest="api", type=_api_style,
        choices=[a.value for a in ApiStyle], default=ApiStyle.GENERATE.value,
        help="generate (or sglang): SGLang's /generate, which reports cached tokens by tier; "
        "openai: /v1/completions (default: %(default)s, as in SGLang's bench_multiturn.py)",
    )
    server.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    server.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default: 600)"
    )
    server.add_argument(
        "--flush-cache", action="store_true", help="POST /flush_cache before the run"
    )
    pacing = parser.add_argument_group("pacing")
    pacing.add_argument(
        "--request-rate", type=float, default=math.inf,
        help="requests per second (default: inf, i.e. as fast as --max-inflight allows)",
    )
    pacing.add_argument(
        "--distribution", choices=[d.value for d in ArrivalDistribution],
        default=ArrivalDistribution.POISSON.value, help="gaps between sends (default: poisson)",
    )
    pacing.add_argument(
        "--max-inflight", "--max-parallel", dest="max_inflight", type=int, default=64,
        help="requests in flight at most; 0 = no limit (default: %(default)s)",
    )
    pacing.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival gaps")
    pacing.add_argument(
        "--warmup", type=int, default=1,
        help="short unrelated requests sent (and not counted) before the run (default: 1)",
    )
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument(
        "--prompt-style", choices=[s.value for s in PromptStyle], default=PromptStyle.TOKENS.value,
        help="tokens: random token ids (exact lengths); text: random words sized with "
        "--tokenizer (default: %(default)s)",
    )
    prompts.add_argument(
        "--tokenizer", default=None,
        help="tokenizer.json (or its model dir) to size text and re-encode answers; "
        "default: UTF-8 bytes, as the byte-level tokenizer of dummy models counts",
    )
    prompts.add_argument(
        "--token-id-range", type=int, nargs=2, default=(0, 256), metavar=("LOW", "HIGH"),
        help="token ids of tokens-style prompts are drawn from [LOW, HIGH) (default: 0 256)",
    )
    prompts.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0)"
    )
    prompts.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="let the model stop early (default: always generate the full output length)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--label", default=None, help="name of this run in reports and plots")
    out.add_argument("--log-file", default=None, help="JSON lines: one record per request")
    out.add_argument("--json-out", default=None, help="write the summary as JSON here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _api_style(value: str) -> str:
    """SGLang's bench clients call the /generate API "sglang"."""
    return ApiStyle.GENERATE.value if value == "sglang" else value


def server_url(args: argparse.Namespace) -> str:
    """--url, else http://--host:--port."""
    url: str | None = args.url
    return url if url else f"http://{args.host}:{args.port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    add_multiturn_arguments(parser)


def add_multiturn_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-turn workload")
    group.add_argument("--num-clients", type=int, default=16)
    group.add_argument("--num-rounds", type=int, default=4)
    group.add_argument(
        "--request-length", type=int, default=1024, help="tokens of each client's first prompt"
    )
    group.add_argument(
        "--sub-question-length", "--sub-question-input-length", dest="sub_question_length",
        type=int, default=128,
        help="tokens each later round adds after the previous answer",
    )
    group.add_argument("--output-length", type=int, default=64, help="tokens per answer")
    group.add_argument(
        "--round-barrier", "--enable-round-barrier", dest="round_barrier", action="store_true",
        help="start round r+1 only when every client finished round r",
    )


def prompt_maker(args: argparse.Namespace) -> PromptMaker:
    low, high = args.token_id_range
    return PromptMaker(PromptStyle(args.prompt_style), load_codec(args.tokenizer), low, high)


def multiturn_workload(args: argparse.Namespace, maker: PromptMaker) -> list[Session]:
    return multiturn_sessions(
        args.num_clients, args.num_rounds, args.request_length, args.sub_question_length,
        args.output_length, maker, args.seed,
    )


def multiturn_working_set(args: argparse.Namespace) -> int:
    return working_set_tokens(
        args.num_clients, args.num_rounds, args.request_length, args.sub_question_length,
        args.output_length,
    )


def args_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as JSON values, for the summary."""
    config: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key.startswith("_"):
            continue
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, float) and math.isinf(value):
            value = "inf"
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        config[key] = value
    return config


# ------------------------------------------------------------------------ runner
@dataclass(frozen=True)
class Pacing:
    request_rate: float = math.inf
    distribution: ArrivalDistribution = ArrivalDistribution.POISSON
    max_inflight: int = 64
    round_barrier: bool = False
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Pacing:
        if args.max_inflight < 0:
            raise WorkloadError("--max-inflight must be >= 0")
        return cls(
            request_rate=args.request_rate,
            distribution=ArrivalDistribution(args.distribution),
            max_inflight=args.max_inflight,
            round_barrier=getattr(args, "round_barrier", False),
            seed=args.seed,
        )


async def run_sessions(
    client: BenchClient, sessions: Sequence[Session], pacing: Pacing, maker: PromptMaker,
    log: JsonlLog | None = None, progress: bool = False,
) -> list[RequestRecord]:
    """Play every session's rounds against the server; one record per request.

    Sends are spaced by the arrival gaps, measured from the previous send; a
    session whose previous round is still running is not ready, and the next
    ready one goes instead (first come, first served).
    """
    # None in the queue wakes the dispatcher after a request task crashed.
    ready: asyncio.Queue[Session | None] = asyncio.Queue()
    for session in sessions:
        ready.put_nowait(session)
    total = sum(s.num_rounds for s in sessions)
    slots = asyncio.Semaphore(pacing.max_inflight or total or 1)
    gaps = arrival_gaps(pacing.distribution, pacing.request_rate, pacing.seed)
    # Round barrier: sessions parked until round r is finished by all that have it.
    parked: dict[int, list[Session]] = {}
    unfinished = {
        r: sum(1 for s in sessions if s.num_rounds > r)
        for r in range(max((s.num_rounds for s in sessions), default=0))
    }
    records: list[RequestRecord] = []
    crashes: list[BaseException] = []
    bar = tqdm(total=total, disable=not progress, unit="req", file=sys.stderr, dynamic_ncols=True)
    run_start = time.perf_counter()

    def requeue(session: Session, finished_round: int) -> None:
        if not pacing.round_barrier:
            if not session.done:
                ready.put_nowait(session)
            return
        unfinished[finished_round] -= 1
        if not session.done:
            parked.setdefault(finished_round, []).append(session)
        if unfinished[finished_round] == 0:
            for waiting in parked.pop(finished_round, []):
                ready.put_nowait(waiting)

    async def run_one(session: Session) -> None:
        plan = session.next_request()
        try:
            result = await client.send(plan.prompt, plan.max_tokens)
            record = RequestRecord.of(
                plan.session, plan.round, plan.group, result, run_start, maker.count(plan.prompt)
            )
            records.append(record)
            if log is not None:
                log.write(record)
            bar.update(1)
            session.record_answer(result.text, result.output_ids)
        except BaseException as error:
            crashes.append(error)
            ready.put_nowait(None)
            raise
        finally:
            slots.release()
        requeue(session, plan.round)

    tasks: set[asyncio.Task[None]] = set()
    last_send = run_start
    try:
        for _ in range(total):
            next_session = await ready.get()
            if next_session is None:
                raise crashes[0]
            session = next_session
            delay = last_send + next(gaps) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            last_send = time.perf_counter()
            task = asyncio.create_task(run_one(session))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    records.sort(key=lambda r: r.sent_s)
    return records


async def run_benchmark(
    args: argparse.Namespace, sessions: Sequence[Session], maker: PromptMaker, url: str,
    label: str, config: dict[str, Any] | None = None,
) -> RunSummary:
    """Warm up, optionally flush, run the sessions and summarize (flags from ``args``)."""
    pacing = Pacing.from_args(args)
    client = BenchClient(
        url, ApiStyle(args.api), model=args.model, temperature=args.temperature,
        ignore_eos=args.ignore_eos, timeout_s=args.request_timeout,
        max_connections=pacing.max_inflight,
        return_token_ids=getattr(args, "return_token_ids", False),
    )
    async with client:
        warm_length = max(1, min(64, min(maker.count(s.parts[0]) for s in sessions)))
        for prompt in warmup_prompts(maker, args.warmup, warm_length, args.seed):
            result = await client.send(prompt, 1)
            if not result.ok:
                raise BenchmarkError(f"warm-up request to {url} failed: {result.error}")
        if args.flush_cache and not await client.flush_cache():
            raise BenchmarkError(f"POST {url}/flush_cache failed")
        with JsonlLog(args.log_file) as log:
            records = await run_sessions(
                client, sessions, pacing, maker, log, progress=not args.no_progress
            )
    return RunSummary.of(label, records, config)


def finish(summary: RunSummary, args: argparse.Namespace) -> int:
    """Print and save a summary; non-zero when any request failed."""
    print(format_summary(summary))
    if args.json_out:
        summary.save(args.json_out)
    if summary.overall.failed:
        print(f"{summary.overall.failed} requests failed", file=sys.stderr)
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        maker = prompt_maker(args)
        sessions = multiturn_workload(args, maker)
        config = args_config(args)
        config["working_set_tokens"] = multiturn_working_set(args)
        label = args.label or f"multiturn-{args.api}"
        summary = asyncio.run(run_benchmark(args, sessions, maker, server_url(args), label, config))
    except (WorkloadError, BenchmarkError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return finish(summary, args)
