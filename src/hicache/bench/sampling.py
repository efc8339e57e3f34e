"""``hicache bench sampling``: one step's sampling, batched against row by row.

For each case (temperature alone, top-k, top-p, both) it times ``sample_tokens``
over a [--batch, --vocab] float32 step, every row sampled with its own seeded
generator, against the row-by-row way it replaced (per row: scale, top-k mask,
softmax, a full sort for top-p, ``torch.multinomial``, one ``.item()``), and
reports the median milliseconds per step.

``--logits`` picks the rows: ``normal`` (standard normal logits: a nearly flat
distribution whose top-p nucleus holds most of the vocabulary, the worst case
for top-p) or ``zipf`` (logits falling with the log of a token's rank, plus
noise: a peaked distribution like a language model's, whose nucleus is small).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from hicache.engine.api import SamplingParams
from hicache.engine.sampling import sample_tokens

CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "both": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="rows sampled per step")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--logits", choices=("normal", "zipf"), default="normal")
    parser.add_argument("--repeats", type=int, default=10, help="steps timed per case")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default=None, help="write raw results here")


def make_logits(kind: str, batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] float32 logits of the kind ``--logits`` names."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(batch, vocab, generator=gen)
    if kind == "normal":
        return noise.to(device)
    rank = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(batch)]) + 1
    return (-1.5 * torch.log(rank.float()) + 0.5 * noise).to(device)


def row_by_row(
    logits: torch.Tensor, params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """The per-row sampler ``sample_tokens`` replaced, as the baseline."""
    tokens = []
    for row, p, generator in zip(logits, params, generators, strict=True):
        scaled = row / p.temperature
        if 0 < p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            drop = ordered.cumsum(dim=-1) - ordered >= p.top_p
            drop[0] = False
            probs = torch.zeros_like(probs).scatter_(0, order, ordered.masked_fill(drop, 0.0))
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens


def time_both(
    old: Callable[[], object], new: Callable[[], object], repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median milliseconds of ``old`` and of ``new``, timed in turns (so that a busy
    machine slows both alike)."""
    old()  # warm up
    new()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((old, times[0]), (new, times[1])):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()  # both read their tokens back: the step's end
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def nucleus_size(logits: torch.Tensor, params: SamplingParams) -> float:
    """The mean number of tokens the case's top-k and top-p keep per row."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    ordered = torch.sort(probs, descending=True).values
    if 0 < params.top_k < ordered.shape[-1]:
        ordered = ordered[:, : params.top_k]
        ordered = ordered / ordered.sum(dim=-1, keepdim=True)
    before = ordered.cumsum(dim=-1) - ordered
    return float((before < params.top_p).sum(dim=-1).double().mean())


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    logits = make_logits(args.logits, args.batch, args.vocab, device)
    results = []
    print(f"batch {args.batch}, vocab {args.vocab}, {args.logits} logits, "
          f"{torch.get_num_threads()} threads, {device}")
    print(f"{'case':<12} {'kept':>8} {'row by row':>12} {'batched':>10} {'speedup':>8}")
    for name in args.cases:
        params = [CASES[name]] * args.batch

        def generators() -> list[torch.Generator]:
            return [torch.Generator(device=device).manual_seed(i) for i in range(args.batch)]

        gens = generators()
        gens2: list[torch.Generator | None] = list(generators())
        old, new = time_both(partial(row_by_row, logits, params, gens),
                             partial(sample_tokens, logits, params, gens2), args.repeats, device)
        kept = nucleus_size(logits, CASES[name])
        results.append({"case": name, "kept_tokens": kept, "row_by_row_ms": old,
                        "batched_ms": new})
        print(f"{name:<12} {kept:>8.0f} {old:>10.1f}ms {new:>8.1f}ms {old / new:>7.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0
