"""``hicache bench attention``: attention backends side by side on one layer of a paged pool.

For each case (a batch of sequences, each with ``extend`` new tokens after a
context of ``context`` tokens; extend 1 = decode), the pool holds the contexts
on shuffled pages, and every backend that runs on ``--device`` computes the
same step: the time per layer is the median of ``--repeats`` calls of
``attend`` (the step's plan is built once, as the model does for all layers).
Each backend's output is checked against the reference (``gather``) first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hicache.attention.backend import ATTENTION_BACKENDS, make_attention_backend
from hicache.config import ConfigError
from hicache.model.batch import ForwardBatch
from hicache.model.config import parse_dtype

DEFAULT_CASES = ("1x512x1", "1x4096x1", "32x1024x1", "128x1024x1", "1x2048x256")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases", nargs="+", default=list(DEFAULT_CASES),
        help="BATCHxCONTEXTxEXTEND: sequences, context tokens before the step, new tokens",
    )
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="write raw results here")


def paged_step(
    batch: int, context: int, extend: int, page_size: int, heads: int, kv_heads: int,
    head_dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of ``batch`` sequences on shuffled pages: (batch, q, k, v, k_cache, v_cache)."""
    gen = torch.Generator().manual_seed(seed)
    total = context + extend
    pages_each = -(-total // page_size)
    num_pages = batch * pages_each
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(batch, pages_each)
    pos = torch.arange(context, total).repeat(batch)
    rows = torch.arange(batch).repeat_interleave(extend)
    out_slots = table[rows, pos // page_size].long() * page_size + pos % page_size
    step = ForwardBatch(
        input_ids=torch.zeros(batch * extend, dtype=torch.int64, device=device),
        positions=pos.to(device), out_slots=out_slots.to(device),
        extend_lens=(extend,) * batch, seq_lens=(total,) * batch,
        page_table=table.to(device),
        table_rows=torch.arange(batch, dtype=torch.int32, device=device), page_size=page_size,
    )
    shape = (num_pages * page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    qkv = torch.randn(batch * extend, heads + 2 * kv_heads, head_dim, generator=gen)
    q, k, v = qkv.to(device=device, dtype=dtype).split((heads, kv_heads, kv_heads), dim=1)
    k_cache.index_copy_(0, step.out_slots, k)
    v_cache.index_copy_(0, step.out_slots, v)
    return step, q, k, v, k_cache, v_cache


def main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype)
    backends = []
    for name in ATTENTION_BACKENDS[1:]:
        try:
            backends.append(make_attention_backend(name, device))
        except ConfigError:
            continue
    results = []
    for case in args.cases:
        batch, context, extend = (int(part) for part in case.lower().split("x"))
        step, q, k, v, k_cache, v_cache = paged_step(
            batch, context, extend, args.page_size, args.heads, args.kv_heads, args.head_dim,
            dtype, device,
        )
        reference = None
        line = [f"B={batch} context={context} extend={extend}:"]
        for backend in backends:
            prepared = backend.prepare(step)
            out = prepared.attend(q, k, v, k_cache, v_cache)
            if reference is None:
                reference = out.float()
            error = (out.float() - reference).abs().max().item()
            times = []
            for _ in range(args.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                prepared.attend(q, k, v, k_cache, v_cache)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            results.append({"backend": backend.name, "batch": batch, "context": context,
                            "extend": extend, "ms_per_layer": ms, "max_abs_error": error})
            line.append(f"{backend.name} {ms:.3f} ms/layer (max err {error:.1e})")
        print("  ".join(line))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "threads": torch.get_num_threads()}, f, indent=2)
    return 0
