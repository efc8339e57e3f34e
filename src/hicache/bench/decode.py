"""``hicache bench decode``: the model's decode step, per batch size, per compute setting.

A model (default: the one ``hicache serve`` serves) computes ``--steps`` decode
steps of ``--batch`` sequences at ``--context`` tokens each, over a paged pool,
with each compute setting: plain weights, oneDNN-prepacked weights (the CPU
default), compiled layer blocks; each with the default attention backend. The
settings run alternately (``--repeats``), so a busy machine slows all of them
alike; the figure is the median step time and the tokens per second it gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.default_model import default_model_path
from hicache.model.loader import load_model
from hicache.model.model import CausalLM

SETTINGS = ("plain", "prepacked", "compiled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: serve's default model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="write raw results here")


def _prefill(model: CausalLM, pool: DevicePool, batch: int, context: int,
             pages_each: int, page_size: int) -> list[torch.Tensor]:
    slots = []
    for b in range(batch):
        base = b * pages_each * page_size
        slots.append(torch.arange(base, base + pages_each * page_size))
        ids = [(7 * i + b) % model.config.vocab_size for i in range(context)]
        model.forward(ForwardBatch.from_sequences([ids], [slots[b][:context]]), pool)
    return slots


def _decode_batch(pages: torch.Tensor, length: int, page_size: int) -> ForwardBatch:
    """One new token for each sequence, whose contexts (``length`` tokens with it) lie on
    the pages of its row of ``pages`` [B, pages each]: the page table the engine's model
    runner hands the model, so attention walks real pages (``from_sequences`` would make
    one-token pages, which the paged kernels walk several times slower)."""
    num_seqs = pages.shape[0]
    position = length - 1
    out_slots = pages[:, position // page_size].long() * page_size + position % page_size
    return ForwardBatch(
        input_ids=torch.full((num_seqs,), 3, dtype=torch.int64),
        positions=torch.full((num_seqs,), position, dtype=torch.int64),
        out_slots=out_slots, extend_lens=(1,) * num_seqs, seq_lens=(length,) * num_seqs,
        page_table=pages, table_rows=torch.arange(num_seqs, dtype=torch.int32),
        page_size=page_size,
    )


def _decode_step_s(model: CausalLM, pool: DevicePool, slots: list[torch.Tensor],
                   context: int, steps: int) -> float:
    page_size = pool.page_size
    pages = torch.stack([s[::page_size] // page_size for s in slots]).to(torch.int32)
    times = []
    for step in range(steps):
        length = context + 1 + step % 4  # stays within the pages each sequence has
        batch = _decode_batch(pages, length, page_size)
        start = time.perf_counter()
        model.forward(batch, pool)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.model_path or default_model_path()
    models: dict[str, CausalLM] = {}
    for setting in args.settings:
        model = load_model(path, "auto", None, "auto", "cpu").model
        if setting == "prepacked" and not model.prepack_weights():
            print("prepacked: oneDNN cannot pack this model's weights here; skipped")
            continue
        if setting == "compiled":
            model.compile_blocks()
        models[setting] = model
    config = next(iter(models.values())).config
    results = []
    with torch.inference_mode():
        for batch in args.batch:
            pages_each = -(-(args.context + 8) // args.page_size)
            samples: dict[str, list[float]] = {name: [] for name in models}
            for model in models.values():  # warm-up (and compilation) outside the timing
                pool = DevicePool(config.kv_geometry(model.dtype), batch * pages_each,
                                  args.page_size)
                slots = _prefill(model, pool, batch, args.context, pages_each, args.page_size)
                _decode_step_s(model, pool, slots, args.context, 2)
            for _ in range(args.repeats):
                for name, model in models.items():
                    pool = DevicePool(config.kv_geometry(model.dtype), batch * pages_each,
                                      args.page_size)
                    slots = _prefill(model, pool, batch, args.context, pages_each,
                                     args.page_size)
                    samples[name].append(
                        _decode_step_s(model, pool, slots, args.context, args.steps))
            line = [f"B={batch:3d} context={args.context}:"]
            for name, values in samples.items():
                step_s = statistics.median(values)
                results.append({"setting": name, "batch": batch, "context": args.context,
                                "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
                                "repeats_ms": [v * 1e3 for v in values]})
                line.append(f"{name} {step_s * 1e3:.1f} ms ({batch / step_s:.1f} tok/s)")
            print("  ".join(line), flush=True)
    print(f"({torch.get_num_threads()} torch threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "threads": torch.get_num_threads(),
                       "loadavg": os.getloadavg()}, f, indent=2)
    return 0
