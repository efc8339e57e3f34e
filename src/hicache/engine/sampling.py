"""Choosing the next token of each sequence from its logits.

Greedy rows (temperature 0, or below ``GREEDY_BELOW_TEMPERATURE``) are one
argmax for the whole batch. Sampled rows apply temperature, top-k and top-p,
then draw with the request's own generator, so a request with a seed gets the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from hicache.engine.api import SamplingParams

# Temperatures below this sample greedily. At 1e-5 two logits 1e-3 apart already differ by
# e^-100 in probability, far below what float32 sampling can tell from zero, so the draw is
# the argmax (short of an exact tie); far below it, ``logits / temperature`` overflows to
# inf (any temperature under ~1e-38 for logits of order 1) and softmax gives NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator (seeded when the request asks) or None for greedy."""
    if is_greedy(params):
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of ``logits`` [num_seqs, vocab]."""
    return [int(t) for t in logits.argmax(dim=-1).tolist()]


def sample_row(
    logits: torch.Tensor, greedy_token: int, params: SamplingParams,
    generator: torch.Generator | None,
) -> int:
    """The token of one sequence: ``greedy_token`` (the argmax of its ``logits`` [vocab],
    float32) when greedy, else a draw with its own generator."""
    if is_greedy(params) or generator is None:
        return greedy_token
    return _draw(logits, params, generator)


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p, and always the top token: the
        # comparison is in float32, where a top_p below ~7e-46 (1e-300 ...) is 0 and would
        # otherwise drop every token, leaving nothing to draw from.
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
