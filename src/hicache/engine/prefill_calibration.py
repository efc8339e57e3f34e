"""A GPU engine's prefill cost, measured once before it serves.

The load-or-recompute choice (``reuse_plan.py``) prices recomputing a prompt with the
live prefill fit (``cost_model.py``). A fresh engine has none, so every choice it makes
is unpriced and it loads whatever the tiers hold. Restarted over a warm L3, a GPU engine
then loads every first hit even where recomputing is faster: on an H200 a whole 2K-token
Qwen3-0.6B prompt came from a file store in 648 ms where recomputing it took 156 ms.
While every request waits on its prefetch nothing is computed, so the fit stays empty
for as long as such requests keep coming.

``calibrate_prefill`` computes a few chunks of a scratch prompt (random tokens in scratch
device pages, freed after; the radix tree and the host and L3 tiers never see them) and
feeds their times to the cost model, as the scheduler feeds its own steps. That also
compiles the prefill kernels before a request pays for it. The first chunk of each kind
is left out by the cost model's warm-up rule (``CostModel.skip_warmup``); the fit forgets
these samples as real steps arrive.

Runs on the thread building the engine, before the scheduler thread starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.engine.api import GenerateRequest
from hicache.engine.cost_model import CostModel
from hicache.engine.model_runner import ModelRunner
from hicache.engine.request import Req
from hicache.estimators import attention_pairs
from hicache.memory.allocator import PageAllocator

logger = logging.getLogger(__name__)

# Scratch prompts, each as its chunks: the first chunk of a prompt is cold, the later ones
# extend what the earlier ones computed. Nine samples past the two warm-up chunks (the
# fit's eight at least; ten when chunks are cut at 2048 tokens, nine at 1024), tokens from
# 256 to 4096 and contexts to 2048 so that the per-token and per-pair costs both vary.
PLAN: tuple[tuple[int, ...], ...] = (
    (256,), (512,), (1024, 256), (1024, 256), (2048, 512), (2048, 1024), (4096,),
)
# Prompts under this many tokens are not worth the start-up time (nor can they fit a curve).
MIN_TOKENS = 256


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate_prefill`` measured: (context, new tokens, seconds) per chunk, and how
    many of them the cost model kept (the rest were warm-ups)."""

    steps: tuple[tuple[int, int, float], ...]
    kept: int


def scaled_plan(max_chunk: int, max_tokens: int) -> list[tuple[int, ...]]:
    """``PLAN`` as the scheduler would compute it: chunks over ``max_chunk`` split into
    chunks of that size (the later ones over a prefix), prompts cut at ``max_tokens``
    (a chunk past it dropped, a prompt with none left dropped); empty when either limit is
    below ``MIN_TOKENS``."""
    if min(max_chunk, max_tokens) < MIN_TOKENS:
        return []
    plan = []
    for chunks in PLAN:
        kept: list[int] = []
        for chunk in chunks:
            while chunk > 0 and sum(kept) + min(chunk, max_chunk) <= max_tokens:
                kept.append(min(chunk, max_chunk))
                chunk -= kept[-1]
            if chunk > 0:
                break
        if kept:
            plan.append(tuple(kept))
    return plan


def calibrate_prefill(
    runner: ModelRunner, allocator: PageAllocator, cost_model: CostModel, vocab_size: int,
    max_chunk: int, sync: Callable[[], None] | None = None,
) -> Calibration:
    """Time the chunks of ``scaled_plan`` on scratch pages and feed them to ``cost_model``.

    Chunks are at most ``max_chunk`` tokens (the scheduler's chunked prefill), prompts at
    most the context and half the free device pages; ``sync`` waits for the device (CUDA:
    ``torch.cuda.synchronize``).
    """
    page_size = runner.page_size
    room = allocator.num_free_pages // 2 * page_size
    plan = scaled_plan(max_chunk, min(runner.max_context_len - 1, room))
    generator = torch.Generator().manual_seed(0)
    steps: list[tuple[int, int, float]] = []
    kept = 0
    for chunks in plan:
        total = sum(chunks)
        ids = torch.randint(0, vocab_size, (total + 1,), generator=generator).tolist()
        stub: Any = None  # nothing is streamed nor detokenized
        req = Req(GenerateRequest(tuple(ids)), "prefill-calibration", stub, stub, None)
        pages = allocator.allocate(-(-(total + 1) // page_size))
        req.pages = pages
        runner.admit(req)
        try:
            for chunk in chunks:
                context = req.num_computed
                began = time.perf_counter()
                runner.forward([(req, chunk)], None, None)
                if sync is not None:
                    sync()
                seconds = time.perf_counter() - began
                req.num_computed += chunk
                steps.append((context, chunk, seconds))
                if cost_model.observe_step(chunk, attention_pairs(chunk, context), 0, seconds):
                    kept += 1
        finally:
            runner.release(req)
            allocator.free(pages)
    return Calibration(tuple(steps), kept)


def describe(calibration: Calibration) -> str:
    """One log line: the chunks' sizes and times."""
    parts: Sequence[str] = [
        f"{new}@{context}:{seconds * 1e3:.0f}ms" for context, new, seconds in calibration.steps
    ]
    return f"{len(parts)} chunks ({calibration.kept} kept): {' '.join(parts)}"
