"""Decodes' TPOT while long prompts prefill beside them, per ``--max-decode-delay-ms``.

For each setting (off, a delay in milliseconds, or ``xF``: a delay of F times the
decode rows' own step, ``--max-decode-delay-factor``) an engine is built in process (no
HTTP) with the given engine flags, and each repeat runs:

- ``--decoders`` requests with short prompts and ``--decode-tokens`` outputs, started
  first and left to reach their decode;
- then ``--prompts`` long prompts (``--prompt-tokens``, ``--prompt-output`` tokens out)
  submitted at once.

The prefill window runs from the long prompts' submission to the last one's first token.
Reported per setting (the median over repeats; settings alternate within each repeat):
the decoders' TPOT inside the window (window seconds over the tokens each decoder got in
it, averaged over decoders), the long prompts' mean TTFT, and the whole run's output
tokens per second. Greedy outputs are checked equal across settings (the budget changes
only how prompts are chunked, never what is computed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.server.engine_args import add_engine_args, engine_config_from_args

# The most warm-up repeats run while the step costs are still unknown.
WARMUP_REPEATS = 5


@dataclass(frozen=True)
class Sample:
    setting: str
    window_s: float
    decode_tpot_ms: float  # decoders' mean time per token inside the prefill window
    prompt_ttft_ms: float  # long prompts' mean TTFT
    output_tok_s: float
    window_steps: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delays-ms", default="off,20,x1",
                        help="comma-separated settings: off, a --max-decode-delay-ms value, "
                        "or xF for --max-decode-delay-factor F")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--prompt-output", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write raw samples here")
    add_engine_args(parser)  # the engine's own flags (model path, threads, chunk ...)


def _tokens(generator: torch.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=generator))


async def _one_repeat(engine: Engine, args: argparse.Namespace, seed: int,
                      setting: str) -> tuple[Sample, list[tuple[int, ...]]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = min(engine.vocab_size, 256)  # byte ids exist in every vocabulary

    def request(n_prompt: int, n_out: int) -> GenerateRequest:
        return GenerateRequest(_tokens(generator, n_prompt, vocab), SamplingParams(
            max_new_tokens=n_out, temperature=0.0, ignore_eos=True))

    decoders = [request(32, args.decode_tokens) for _ in range(args.decoders)]
    prompts = [request(args.prompt_tokens, args.prompt_output) for _ in range(args.prompts)]
    # Per decoder: (arrival time, tokens) of each output.
    stamps: list[list[tuple[float, int]]] = [[] for _ in decoders]
    outputs: list[list[int]] = [[] for _ in decoders + prompts]
    first_token: list[float] = [0.0] * len(prompts)
    started = asyncio.Event()

    async def decode(i: int, req: GenerateRequest) -> None:
        async for out in engine.generate(req):
            stamps[i].append((time.perf_counter(), len(out.token_ids)))
            outputs[i].extend(out.token_ids)
            if all(len(s) >= 2 for s in stamps):
                started.set()

    async def prefill(i: int, req: GenerateRequest) -> None:
        async for out in engine.generate(req):
            if out.token_ids and not first_token[i]:
                first_token[i] = time.perf_counter()
            outputs[len(decoders) + i].extend(out.token_ids)

    began = time.perf_counter()
    tasks = [asyncio.create_task(decode(i, r)) for i, r in enumerate(decoders)]
    await started.wait()
    submitted = time.perf_counter()
    steps_before = engine.scheduler.counters.num_steps
    await asyncio.gather(*(prefill(i, r) for i, r in enumerate(prompts)))
    window_end = max(first_token)
    window_steps = engine.scheduler.counters.num_steps - steps_before
    await asyncio.gather(*tasks)
    ended = time.perf_counter()
    window = window_end - submitted
    tpots = []
    for s in stamps:
        got = sum(n for t, n in s if submitted < t <= window_end)
        tpots.append(window / max(got, 1))
    total_out = sum(len(o) for o in outputs)
    sample = Sample(setting, window, 1000 * statistics.mean(tpots),
                    1000 * statistics.mean(t - submitted for t in first_token),
                    total_out / (ended - began), window_steps)
    return sample, [tuple(o) for o in outputs]


def main(args: argparse.Namespace) -> int:
    settings = [s.strip() for s in args.delays_ms.split(",") if s.strip()]
    engines: dict[str, Engine] = {}
    for setting in settings:
        # off; xF: --max-decode-delay-factor F; else --max-decode-delay-ms
        args.max_decode_delay_ms = args.max_decode_delay_factor = None
        if setting.startswith("x"):
            args.max_decode_delay_factor = float(setting[1:])
        elif setting != "off":
            args.max_decode_delay_ms = float(setting)
        engines[setting] = build_engine(engine_config_from_args(args))
    samples: list[Sample] = []
    try:
        for engine in engines.values():
            # Warm-up: kernels, the allocator, and the step costs the budget prices with
            # (until they are measured every step takes the full chunk).
            for extra in range(WARMUP_REPEATS):
                asyncio.run(_one_repeat(engine, args, args.seed + 10_000 + extra, "warm-up"))
                if engine.scheduler.cost_model.steps.snapshot() is not None:
                    break
        for repeat in range(args.repeats):
            seen: list[tuple[int, ...]] | None = None
            for setting, engine in engines.items():
                sample, outs = asyncio.run(
                    _one_repeat(engine, args, args.seed + repeat, setting))
                samples.append(sample)
                if seen is not None and outs != seen:
                    print(f"warning: greedy outputs differ under {setting}")
                seen = outs
                print(f"repeat {repeat} {setting:>5}: decode TPOT in window "
                      f"{sample.decode_tpot_ms:.1f} ms, prompt TTFT {sample.prompt_ttft_ms:.0f}"
                      f" ms, {sample.output_tok_s:.1f} output tok/s, window "
                      f"{sample.window_steps} steps", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print("| setting | decode TPOT in prefill window ms | prompt TTFT ms | output tok/s |")
    print("| --- | --- | --- | --- |")
    for setting in settings:
        mine = [s for s in samples if s.setting == setting]
        print(f"| {setting} | {statistics.median(s.decode_tpot_ms for s in mine):.1f} | "
              f"{statistics.median(s.prompt_ttft_ms for s in mine):.0f} | "
              f"{statistics.median(s.output_tok_s for s in mine):.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in samples], f, indent=1)
    return 0
