"""``hicache bench cold-engine``: cold prompts through an engine built as ``hicache serve``
builds it, in this process, with each thread's CPU time over the run.

No HTTP and no client process: what the engine's configuration costs a cold prompt shows
without the noise of a server's front end. ``--serve-args`` takes ``hicache serve``'s own
flags (default: none, the embedded defaults), so the default and, say, a flat pool
(``--disable-hierarchical-cache --hicache-storage-backend none``) are built alike; one
configuration a run, so alternate runs from the shell. Every prompt is random tokens from
``--seed``: give each run its own seed, or a file L3 left by an earlier run holds them.
After the engine is built it idles ``--settle-s`` (the host pool is faulted in while
idle), answers two warm-up prompts, then ``--prompts`` prompts of ``--prompt-len`` tokens,
``--output-len`` tokens each, ``--concurrency`` in flight. Reported: the run's duration,
the mean and p99 time to first token, and the mean time per output token after the first
(TPOT, per request then averaged, as ``vllm bench serve`` counts it): a scheduler that
favours prompts shows as a lower TTFT and a higher TPOT.

Per thread (named where Python named it; torch's OpenMP workers are ``python``): CPU
seconds and voluntary / involuntary context switches over the timed run, from
``/proc/self/task`` (Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import threading
import time
from dataclasses import asdict, dataclass

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine

WARMUP_PROMPTS = 2


@dataclass(frozen=True)
class ThreadUse:
    name: str
    cpu_s: float
    voluntary_switches: int
    involuntary_switches: int


@dataclass(frozen=True)
class Timing:
    """One request's seconds to its first token and per later token (None: one token)."""

    ttft_s: float
    tpot_s: float | None


@dataclass(frozen=True)
class Result:
    duration_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float | None  # None when no request had a second token
    threads: list[ThreadUse]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serve-args", default="",
                        help="hicache serve's flags for the engine, as one string")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=20.0,
                        help="idle seconds after the engine is built (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _thread_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _thread_counters(names: dict[int, str]) -> dict[int, tuple[str, float, int, int]]:
    """Per thread of this process: (name, CPU seconds, voluntary and involuntary switches)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float, int, int]] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            with open(f"/proc/self/task/{entry}/stat") as stat_file:
                stat = stat_file.read()
            with open(f"/proc/self/task/{entry}/status") as status_file:
                status = status_file.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu_ns = _cpu_ns(entry)
        cpu_s = cpu_ns / 1e9 if cpu_ns is not None else (
            (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime, in clock ticks
        switches = {
            key: int(value) for key, _, value in
            (line.partition(":\t") for line in status.splitlines())
            if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        }
        name = names.get(tid, stat[stat.index("(") + 1 : stat.rindex(")")])
        found[tid] = (name, cpu_s, switches["voluntary_ctxt_switches"],
                      switches["nonvoluntary_ctxt_switches"])
    return found


def _cpu_ns(tid: str) -> int | None:
    """A thread's nanoseconds on a CPU (``schedstat``; None where the kernel lacks it): the
    clock ticks of ``stat`` count nothing for a thread that ran under 10 ms."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as schedstat:
            return int(schedstat.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


async def _prompts(engine: Engine, args: argparse.Namespace, count: int,
                   rng: random.Random) -> list[Timing]:
    """``count`` prompts, ``args.concurrency`` in flight; each one's timing."""
    vocab = engine.vocab_size
    gate = asyncio.Semaphore(args.concurrency)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [tuple(rng.randrange(vocab) for _ in range(args.prompt_len)) for _ in range(count)]

    async def one(ids: tuple[int, ...]) -> Timing:
        async with gate:
            began = time.perf_counter()
            first: float | None = None
            tokens = 0
            async for output in engine.generate(GenerateRequest(ids, params)):
                if output.error is not None:
                    raise RuntimeError(f"a prompt failed: {output.error}")
                tokens += len(output.token_ids)
                if first is None and tokens:
                    first = time.perf_counter() - began
            assert first is not None
            last = time.perf_counter() - began
            return Timing(first, (last - first) / (tokens - 1) if tokens > 1 else None)

    return list(await asyncio.gather(*(one(ids) for ids in prompts)))


def measure(engine: Engine, args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    asyncio.run(_prompts(engine, args, WARMUP_PROMPTS, rng))
    names = _thread_names()
    before = _thread_counters(names)
    began = time.perf_counter()
    timings = asyncio.run(_prompts(engine, args, args.prompts, rng))
    duration = time.perf_counter() - began
    names.update(_thread_names())
    threads = []
    for tid, (name, cpu_s, voluntary, involuntary) in _thread_counters(names).items():
        _, cpu0, voluntary0, involuntary0 = before.get(tid, (name, 0.0, 0, 0))
        threads.append(ThreadUse(name, round(cpu_s - cpu0, 4), voluntary - voluntary0,
                                 involuntary - involuntary0))
    threads.sort(key=lambda use: -use.cpu_s)
    ttfts = sorted(timing.ttft_s for timing in timings)
    tpots = [timing.tpot_s for timing in timings if timing.tpot_s is not None]
    return Result(
        duration, 1000 * sum(ttfts) / len(ttfts), 1000 * _percentile(ttfts, 0.99),
        1000 * sum(tpots) / len(tpots) if tpots else None, threads,
    )


def _percentile(ordered: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def main(args: argparse.Namespace) -> int:
    # The server's own modules, imported only when this benchmark runs.
    from hicache.cli import build_parser
    from hicache.engine.build import build_engine
    from hicache.server.engine_args import engine_config_from_args
    from hicache.server.serve import with_default_model

    serve_args = build_parser("serve").parse_args(["serve", *shlex.split(args.serve_args)])
    engine = build_engine(engine_config_from_args(with_default_model(serve_args)))
    try:
        time.sleep(args.settle_s)
        result = measure(engine, args)
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    print(f"serve args: {args.serve_args or '(defaults)'}; {args.prompts} prompts x "
          f"{args.prompt_len} tokens, {args.output_len} out, {args.concurrency} in flight")
    tpot = "-" if result.mean_tpot_ms is None else f"{result.mean_tpot_ms:.0f} ms"
    print(f"duration {result.duration_s:.3f} s, mean TTFT {result.mean_ttft_ms:.0f} ms, "
          f"p99 TTFT {result.p99_ttft_ms:.0f} ms, mean TPOT {tpot}")
    for use in result.threads:
        if use.cpu_s >= 0.01 or use.voluntary_switches > 20:
            print(f"  {use.name:28s} cpu {use.cpu_s:6.2f} s  switches {use.voluntary_switches:6d}"
                  f" voluntary {use.involuntary_switches:6d} involuntary")
    return 0
