"""``hicache bench step``: the scheduler's host time per decode step, model forward excluded.

What a step costs besides the model is the engine's own overhead: planning the
batch, building its inputs, the page table, sampling and handing tokens out. It
must not grow with the contexts' lengths, or long conversations pay for it on
every token. This benchmark runs the real scheduler (cache, runner, sampling,
detokenizing, emitting) over a model stub whose forward returns zero logits at
once, with ``--batch`` requests decoding at ``--context`` tokens each, their
outputs handed to the output thread and on to an event loop as the engine does,
and reports the wall time per step (the stub's own time subtracted), the
scheduler thread's CPU time per step (the host work a forward waits for) and the
output thread's (detokenizing and streaming, beside the scheduler; in this
benchmark, with no forward releasing the GIL, the two threads take turns, so the
wall time is about their sum).

The stub's vocabulary is ``--vocab`` (default 2): the figure is then the engine's
own work per step, which must stay O(batch). Sampling over a real vocabulary adds
the arithmetic of an argmax (or a draw) over [batch, vocab], the device's work:
``--vocab 32000`` includes it (on the CPU it runs on the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import cast

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig
from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.config import SchedulerLimits
from hicache.engine.output_thread import LoopSink, Stream
from hicache.engine.request import Phase, Req
from hicache.engine.scheduler import Scheduler
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.model.batch import ForwardBatch
from hicache.model.model import CausalLM
from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.detokenizer import IncrementalDetokenizer

DEFAULT_CASES = ("256x2048", "1000x1024")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases", nargs="+", default=list(DEFAULT_CASES),
        help="BATCHxCONTEXT pairs: requests decoding together, tokens of context each",
    )
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per case")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2, help="the stub model's vocabulary")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument(
        "--profile", default=None,
        help="write a cProfile of the timed steps of the first case to this file",
    )


class StubModel:
    """What the runner calls: ``forward(batch, pool, wait_layer)`` -> zero logits, timed."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.seconds = 0.0
        self._logits = torch.zeros((0, vocab))

    def forward(
        self, batch: ForwardBatch, pool: DevicePool, wait_layer: object = None
    ) -> torch.Tensor:
        start = time.perf_counter()
        rows = len(batch.logit_rows())
        if len(self._logits) < rows:  # kept: a fresh [B, vocab] per step would be page faults
            self._logits = torch.zeros((rows, self.vocab))
        logits = self._logits[:rows]
        self.seconds += time.perf_counter() - start
        return logits


def run_case(
    batch: int, context: int, steps: int, page_size: int, vocab: int,
    profile: str | None = None,
) -> dict[str, float]:
    stub = StubModel(vocab)
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    max_context = context + steps + 4
    pages = batch * -(-max_context // page_size) + 8
    cache = HierarchicalCache(CacheConfig(page_size=page_size), geometry, pages)
    config = SchedulerLimits(
        max_running_requests=batch, chunked_prefill_size=max(batch * context, 1),
        max_context_len=max_context,
    )
    tokenizer = ByteTokenizer()
    scheduler = Scheduler(cast(CausalLM, stub), cache, config, tokenizer.eos_token_ids)
    # Outputs go where the engine sends them: batched per step to an event loop (one
    # that does not run: its callbacks queue up, as a busy server's would).
    loop = asyncio.new_event_loop()
    outputs: asyncio.Queue[GenerateOutput] = asyncio.Queue()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = tuple(int(t) for t in rng.integers(0, 256, size=context - 1))
        request = GenerateRequest(ids, params)
        scheduler.submit(Req(
            request=request, rid=str(i), stream=Stream(LoopSink(loop), outputs),
            detokenizer=IncrementalDetokenizer(tokenizer, ids), generator=None,
        ))
    # Prefill (one step with a large enough chunk budget), then one decode step more:
    # the requests are then at ``context`` tokens.
    while scheduler.num_running < batch or any(r.phase is not Phase.DECODE
                                                 for r in scheduler.running_requests()):
        scheduler.step()
    scheduler.step()
    scheduler.outputs.flush()
    times: list[float] = []
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    output_cpu_start = scheduler.outputs.cpu_seconds
    cpu_times: list[float] = []
    for _ in range(steps):
        stub.seconds = 0.0
        start = time.perf_counter()
        cpu_start = time.thread_time()
        scheduler.step()
        scheduler.outputs.flush()
        cpu_times.append(time.thread_time() - cpu_start - stub.seconds)
        times.append(time.perf_counter() - start - stub.seconds)
    scheduler.outputs.close()  # waits for the output thread to catch up
    output_cpu = scheduler.outputs.cpu_seconds - output_cpu_start
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    assert scheduler.num_running == batch, "every request decodes through the timed steps"
    cache.close()
    loop.close()
    return {
        "batch": batch, "context": context, "steps": steps,
        "median_ms": statistics.median(times) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        # CPU time of the scheduler thread per step (what it cannot overlap with a
        # forward), and of the output thread (detokenizing and streaming, in parallel).
        "scheduler_cpu_median_ms": statistics.median(cpu_times) * 1e3,
        "output_thread_cpu_ms_per_step": output_cpu / steps * 1e3,
    }


def main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = []
    for index, case in enumerate(args.cases):
        batch, context = (int(part) for part in case.lower().split("x"))
        profile = args.profile if index == 0 else None
        result = run_case(batch, context, args.steps, args.page_size, args.vocab, profile)
        results.append(result)
        print(
            f"B={batch:5d} L={context:6d}: host time per decode step "
            f"median {result['median_ms']:.2f} ms, mean {result['mean_ms']:.2f} ms, "
            f"p90 {result['p90_ms']:.2f} ms; CPU: scheduler thread median "
            f"{result['scheduler_cpu_median_ms']:.2f} ms, output thread "
            f"{result['output_thread_cpu_ms_per_step']:.2f} ms  (vocab {args.vocab}, "
            f"page {args.page_size}, {torch.get_num_threads()} threads)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "loadavg": list(_loadavg())}, f, indent=2)
    return 0


def _loadavg() -> tuple[float, float, float]:
    import os

    return os.getloadavg()
