"""``hicache bench prefill``: cold prefill throughput, our model against transformers.

A dummy-weight model of ``--preset`` (default llama3-8b on CUDA, tiny on CPU)
is built, and next to it the transformers model of the same architecture
(``attn_implementation="sdpa"``) holding the very same weight tensors: its
q/k/v and gate/up projections are views of our fused ones, so nothing is copied
and nothing touches the disk. For each prompt length in ``--tokens``, both
compute a cold prefill of the same random prompt: warm-up runs, then
``--repeats`` timed runs alternating between the two, each between device
synchronizations; the median is reported.

Both do what a serving prefill does: keep the prompt's K/V (ours in the paged
pool, transformers in its DynamicCache) and project only the last position to
logits (transformers' ``logits_to_keep=1``, as its ``generate`` does). The last
column is the largest difference between the two models' last-token logits:
near 0 in float32, rounding-sized in bf16, large only if they disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hicache.config import ConfigError
from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.config import dtype_name, parse_dtype
from hicache.model.loader import load_model
from hicache.model.model import CausalLM

_CUDA_DEFAULTS = ("llama3-8b", "1024,4096,8192")
_CPU_DEFAULTS = ("tiny", "64,256")


@dataclass(frozen=True)
class Result:
    tokens: int
    ours_median_s: float
    hf_median_s: float
    ours_tokens_per_s: float
    hf_tokens_per_s: float
    speedup: float  # ours / transformers throughput
    max_abs_logit_diff: float
    ours_samples_s: list[float]
    hf_samples_s: list[float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    preset, tokens = _CUDA_DEFAULTS if cuda else _CPU_DEFAULTS
    parser.add_argument(
        "--preset", default=preset, help=f"model shape (default: {preset} on this machine)"
    )
    parser.add_argument(
        "--tokens", default=tokens, help=f"comma-separated prompt lengths (default: {tokens})"
    )
    parser.add_argument(
        "--dtype", default="auto", help="float32 / bfloat16 / float16; auto: the preset's"
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model and length")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--page-size", type=int, default=16, help="our KV pool's page size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None, help="write raw results here")


# ---------------------------------------------------------------------- transformers twin
def transformers_twin(model: CausalLM) -> Any:
    """The transformers model computing what ``model`` computes, on its weight tensors.

    Built on the meta device (no memory, no random init), then every parameter is
    assigned a view of ours; only the RoPE buffers are then computed on the real device.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # a dev dependency, not a serving one
        raise ConfigError(
            "hicache bench prefill compares against Hugging Face transformers: "
            "pip install transformers"
        ) from e

    raw = model.config.to_hf_dict()
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            hf_config, dtype=model.dtype, attn_implementation="sdpa"
        )
    weights = dict(model.hf_weights())
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = model.embed_tokens  # assigned to both: still tied
    hf.load_state_dict(weights, strict=True, assign=True)
    # Its RoPE frequencies are buffers left on meta: computed afresh (float32, on the CPU
    # as transformers computes them) and moved to the model's device.
    with torch.device("cpu"):
        rotary = type(hf.model.rotary_emb)(config=hf.config)
    hf.model.rotary_emb = rotary.to(model.device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model has tensors nobody filled: {left[:5]}")
    hf.requires_grad_(False)
    return hf.eval()


# ---------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _measure(
    model: CausalLM, hf: Any, pool: DevicePool, num_tokens: int, args: argparse.Namespace
) -> Result:
    device = model.device
    rng = random.Random(args.seed + num_tokens)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(num_tokens)]
    # The prompt's pages in shuffled order, as a cache that has been in use hands them out.
    pages = list(range(pool.num_pages))
    rng.shuffle(pages)
    slots = pool.slots(torch.tensor(pages[: -(-num_tokens // pool.page_size)]))[:num_tokens]
    batch = ForwardBatch.from_sequences([prompt], [slots], device=device)
    input_ids = torch.tensor([prompt], device=device)

    def ours() -> torch.Tensor:
        logits: torch.Tensor = model(batch, pool)
        return logits[0]

    @torch.inference_mode()
    def theirs() -> torch.Tensor:
        out = hf(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits
        return logits[0, -1]

    for _ in range(args.warmup):
        ours()
        theirs()
    ours_s: list[float] = []
    hf_s: list[float] = []
    diff = 0.0
    for _ in range(args.repeats):  # alternating: drifting clocks or heat hit both alike
        seconds, ours_logits = _timed(ours, device)
        ours_s.append(seconds)
        seconds, hf_logits = _timed(theirs, device)
        hf_s.append(seconds)
        diff = max(diff, float((ours_logits.float() - hf_logits.float()).abs().max()))
    ours_median, hf_median = statistics.median(ours_s), statistics.median(hf_s)
    return Result(
        tokens=num_tokens,
        ours_median_s=ours_median,
        hf_median_s=hf_median,
        ours_tokens_per_s=num_tokens / ours_median,
        hf_tokens_per_s=num_tokens / hf_median,
        speedup=hf_median / ours_median,
        max_abs_logit_diff=diff,
        ours_samples_s=ours_s,
        hf_samples_s=hf_s,
    )


# ---------------------------------------------------------------------- report
def _print_table(results: list[Result], header: str) -> None:
    print(header)
    print()
    print(
        "| tokens | hicache ms | hicache tok/s | transformers ms | transformers tok/s "
        "| hicache / transformers | max abs Δlogit |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.tokens} | {r.ours_median_s * 1e3:.2f} | {r.ours_tokens_per_s:,.0f} "
            f"| {r.hf_median_s * 1e3:.2f} | {r.hf_tokens_per_s:,.0f} | {r.speedup:.2f}x "
            f"| {r.max_abs_logit_diff:.2e} |"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.warmup < 0:
        print("--repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        print(f"--tokens {args.tokens!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    if not lengths or min(lengths) < 1:
        print("--tokens: give at least one positive prompt length", file=sys.stderr)
        return 2
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype)
    loaded = load_model(None, "dummy", args.preset, dtype, device, seed=args.seed)
    model, config = loaded.model, loaded.config
    if max(lengths) > config.max_position_embeddings:
        print(
            f"--tokens: {max(lengths)} is past {args.preset}'s max_position_embeddings "
            f"({config.max_position_embeddings})",
            file=sys.stderr,
        )
        return 2
    hf = transformers_twin(model)
    pool = DevicePool(
        config.kv_geometry(), math.ceil(max(lengths) / args.page_size), args.page_size, device
    )

    import transformers

    header = (
        f"hicache bench prefill: {args.preset} ({config.architecture.value}, "
        f"{config.num_layers} layers, {dtype_name(model.dtype)}) on {_device_name(device)}; "
        f"cold prefill, median of {args.repeats} after {args.warmup} warm-up; "
        f"torch {torch.__version__}, transformers {transformers.__version__} (sdpa)"
    )
    print(header, file=sys.stderr, flush=True)
    results: list[Result] = []
    for num_tokens in lengths:
        result = _measure(model, hf, pool, num_tokens, args)
        results.append(result)
        # Progress as we go: a run cut short still shows what it measured.
        print(
            f"{num_tokens} tokens: hicache {result.ours_median_s * 1e3:.2f} ms, "
            f"transformers {result.hf_median_s * 1e3:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            _write_json(args.json, header, results)
    _print_table(results, header)
    return 0


def _write_json(path: str, header: str, results: list[Result]) -> None:
    with open(path, "w") as handle:
        json.dump({"setup": header, "results": [asdict(r) for r in results]}, handle, indent=1)
