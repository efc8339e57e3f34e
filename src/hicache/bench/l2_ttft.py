"""TTFT of a request whose whole prefix sits in L2, next to its physical bound.

For each context length the engine (in process, no HTTP) answers, with one
output token each:

- cold: the prefix plus a suffix, nothing cached;
- L1 hit: the prefix cached on the device, a new suffix of the same length;
- L2 hit: the prefix evicted from the device first, so its KV is loaded from
  host memory layer by layer while the suffix is computed.

The bound for the L2 hit is what it cannot avoid: moving the prefix's KV bytes
host->device at the bandwidth of one contiguous pinned copy (measured in the
same run, as ``hicache bench transfer`` does) plus the L1-hit TTFT (computing
the suffix over a cached prefix, scheduling included). ``x bound`` is the L2
TTFT over that sum; the design target is <= 1.25.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from hicache.bench.transfer import Timer
from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.server.engine_args import add_engine_args, engine_config_from_args


@dataclass(frozen=True)
class Result:
    context_tokens: int
    suffix_tokens: int
    kv_bytes: int
    h2d_gbps: float
    cold_ms: float
    l1_ms: float
    l2_ms: float
    bound_ms: float
    cold_samples: list[float]
    l1_samples: list[float]
    l2_samples: list[float]

    @property
    def ratio(self) -> float:
        return self.l2_ms / self.bound_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--contexts", default=None,
        help="comma-separated prefix lengths in tokens (default: 4096,16384 on CUDA, 512,2048 on "
        "CPU)",
    )
    parser.add_argument("--suffix", type=int, default=64, help="new tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per tier (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write raw results here")
    # The engine's own flags (model preset, device, page size, layout, io backend ...).
    add_engine_args(parser)
    parser.set_defaults(enable_hierarchical_cache=True, page_size=64)


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


class TierError(RuntimeError):
    """A measured request was not served from the tier it was meant to measure."""


def _ttft_s(engine: Engine, ids: list[int], tier: str | None = None, expect: int = 0) -> float:
    """TTFT of one request; with ``tier``, check ``expect`` prompt tokens came from it."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    async def one() -> GenerateOutput:
        last = None
        async for out in engine.generate(GenerateRequest(tuple(ids), params)):
            last = out
        assert last is not None and last.finished
        return last

    out = asyncio.run(one())
    if tier is not None and getattr(out.cached_tokens, tier) < expect:
        raise TierError(f"expected {expect} cached {tier} tokens, got {out.cached_tokens}")
    assert out.ttft_s is not None
    return out.ttft_s


def _h2d_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    samples = Timer(device, repeats)(lambda: dev.copy_(host, non_blocking=True))
    return nbytes / statistics.median(samples) / 1e9


def measure(engine: Engine, context: int, suffix: int, repeats: int, seed: int) -> Result:
    generator = torch.Generator().manual_seed(seed + context)
    vocab = min(engine.vocab_size, 256)  # byte ids exist in every preset's vocabulary

    def tokens(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, vocab, (n,), generator=generator)]

    device = engine.cache.device_pool.device
    cached = context // engine.cache.page_size * engine.cache.page_size  # whole pages
    cold: list[float] = []
    l1: list[float] = []
    l2: list[float] = []
    # Warm-up (kernels, allocator), then each repetition uses a fresh prefix.
    _ttft_s(engine, tokens(context + suffix))
    for _ in range(repeats):
        prefix = tokens(context)
        cold.append(_ttft_s(engine, prefix + tokens(suffix)))
        l1.append(_ttft_s(engine, prefix + tokens(suffix), "device", cached))
        engine.evict_device_cache()
        l2.append(_ttft_s(engine, prefix + tokens(suffix), "host", cached))
        assert engine.flush_cache()  # the next prefix starts from empty pools
    kv_bytes = context * engine.cache.device_pool.geometry.bytes_per_token
    gbps = _h2d_gbps(device, kv_bytes, repeats)
    l1_s = statistics.median(l1)
    bound_s = kv_bytes / (gbps * 1e9) + l1_s
    return Result(
        context, suffix, kv_bytes, gbps,
        cold_ms=statistics.median(cold) * 1e3, l1_ms=l1_s * 1e3,
        l2_ms=statistics.median(l2) * 1e3, bound_ms=bound_s * 1e3,
        cold_samples=cold, l1_samples=l1, l2_samples=l2,
    )


def main(args: argparse.Namespace) -> int:
    device = _device(args)
    if args.model_preset is None and args.model_path is None:
        args.model_preset = "llama3-8b" if device.type == "cuda" else "tiny"
    contexts = (
        [int(c) for c in args.contexts.split(",")] if args.contexts
        else ([4096, 16384] if device.type == "cuda" else [512, 2048])
    )
    if args.max_total_tokens is None:  # room for the longest request, twice over
        args.max_total_tokens = 2 * (max(contexts) + args.suffix + args.page_size)
    engine = build_engine(engine_config_from_args(args))
    try:
        cache = engine.cache
        if cache.host_pool is None:
            print("l2-ttft needs the host tier: drop --disable-hierarchical-cache")
            return 2
        results = [measure(engine, c, args.suffix, args.repeats, args.seed) for c in contexts]
    finally:
        engine.shutdown()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    io = cache.controller.io.name if cache.controller is not None else "none"
    print(
        f"hicache bench l2-ttft: {engine.model_name} on {name}, page {cache.page_size}, "
        f"layout {cache.config.mem_layout.value}, io {io}, "
        f"suffix {args.suffix} tokens, median of {args.repeats}\n"
    )
    print("| context | KV MB | h2d GB/s | cold ms | L1 hit ms | L2 hit ms | bound ms | x bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.context_tokens} | {r.kv_bytes / 1e6:.1f} | {r.h2d_gbps:.1f} | {r.cold_ms:.1f} "
            f"| {r.l1_ms:.1f} | {r.l2_ms:.1f} | {r.bound_ms:.1f} | {r.ratio:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in results], out, indent=1)
    return 0
