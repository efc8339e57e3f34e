"""Choosing the next token of each sequence from its logits.

Greedy rows (temperature 0) are one argmax for the whole batch. Sampled rows
apply temperature, top-k and top-p, then draw with the request's own
generator, so a request with a seed gets the same tokens whatever else is in
the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.engine.api import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator (seeded when the request asks) or None for greedy."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [num_seqs, vocab] (float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature == 0 or generator is None:
            continue
        tokens[row] = _draw(logits[row], p, generator)
    return [int(t) for t in tokens]


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
