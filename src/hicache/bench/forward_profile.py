"""``hicache bench forward``: where the model's forward spends its time, against its FLOP floor.

A model (default: the one ``hicache serve`` serves, weights prepacked as the engine
packs them) computes a cold prompt of ``--prompt`` tokens in chunks of ``--chunk``
(as the scheduler's chunked prefill hands it over: each chunk after the first reads
the earlier chunks' K/V from the pool through real pages), then decode steps of
``--batch`` sequences at ``--context`` tokens. Each is timed (median of
``--repeats``) and its linear layers' FLOPs counted, which gives the GFLOP/s the
step reaches overall; with ``--profile`` one more run goes under torch.profiler
and the time is split by kind of op (``op_kind``): the projections' GEMMs, attention,
and the rest (norms, RoPE, SiLU, residual adds, K/V writes, gathers).

A prompt only needs its last position's logits: the model projects that row alone
onto the vocabulary, so the head counts once per prompt, not per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from hicache.bench.decode import _decode_batch
from hicache.config import ConfigError
from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.default_model import default_model_path
from hicache.model.loader import load_model
from hicache.model.model import CausalLM, DecoderLayer

# torch.profiler names of the ops each kind covers (self time; everything else is "other").
_LINEAR_OPS = frozenset({"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm"})
# hicache::attention*: the CPU backend's prefill kernel (called through ctypes, it is no
# torch op; the backend names it for the profiler).
_ATTENTION_PREFIXES = ("aten::_scaled_dot_product", "aten::_flash_attention",
                       "hicache::attention")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: serve's default model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--prompt", type=int, default=1024,
                        help="cold prompt tokens (0: decode steps only)")
    parser.add_argument("--chunk", type=int, nargs="+", default=[256],
                        help="prefill chunk in tokens (0: the whole prompt in one step); "
                        "several: each in turn, timed alternately")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8],
                        help="decode batches (none: the prompt alone)")
    parser.add_argument("--context", type=int, default=512, help="decode context tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--no-prepack", action="store_true", help="plain F.linear weights")
    parser.add_argument("--few-rows", choices=("auto", "compare"), default="auto",
                        help="auto: the decode steps' weights as the server picks them; "
                        "compare: each decode batch timed in turns over the blocked copies "
                        "(the few-row kernel) and over the packed ones")
    parser.add_argument("--profile", action="store_true", help="split each case's time by op kind")
    parser.add_argument("--json", default=None, help="write raw results here")


def op_kind(name: str) -> str:
    """"linear", "attention" or "other" for a torch.profiler op name."""
    if name in _LINEAR_OPS:
        return "linear"
    if name.startswith(_ATTENTION_PREFIXES):
        return "attention"
    return "other"


def shares_by_kind(self_times: Iterable[tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Each kind's share of ``wall_s``, from (op name, self time) pairs; "outside" is the
    rest: what no torch op ran (the decode attention kernel, called through ctypes, and
    Python between ops)."""
    totals: dict[str, float] = defaultdict(float)
    for name, seconds in self_times:
        totals[op_kind(name)] += seconds
    shares = {kind: totals[kind] / wall_s for kind in ("linear", "attention", "other")}
    shares["outside"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights a decode step reads whole: every projection and the head."""
    return sum(w.numel() * w.element_size() for w in _projections(model)) + (
        model.lm_head_weight.numel() * model.lm_head_weight.element_size())


def _projections(model: CausalLM) -> list[torch.Tensor]:
    weights: list[torch.Tensor] = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]
    return weights


def linear_flops(model: CausalLM, tokens: int, logit_rows: int) -> float:
    """FLOPs of one step's GEMMs: every projection for ``tokens`` rows, the head for
    ``logit_rows`` (attention, whose FLOPs depend on the contexts, is not counted)."""
    per_token = sum(w.numel() for w in _projections(model))
    return 2.0 * (per_token * tokens + model.lm_head_weight.numel() * logit_rows)


def prompt_chunks(prompt: list[int], pages: torch.Tensor, page_size: int,
                  chunk: int) -> list[ForwardBatch]:
    """The steps of a cold prompt on the pool pages ``pages`` [pages] in chunks of ``chunk``
    tokens (0: one step); each step's page table holds the pages of everything so far."""
    size = chunk if chunk > 0 else len(prompt)
    steps = []
    for start in range(0, len(prompt), size):
        end = min(start + size, len(prompt))
        positions = torch.arange(start, end)
        used = -(-end // page_size)
        steps.append(ForwardBatch(
            input_ids=torch.tensor(prompt[start:end], dtype=torch.int64),
            positions=positions,
            out_slots=pages[positions // page_size].long() * page_size + positions % page_size,
            extend_lens=(end - start,), seq_lens=(end,),
            page_table=pages[:used][None].to(torch.int32),
            table_rows=torch.zeros(1, dtype=torch.int32), page_size=page_size,
        ))
    return steps


def _step(model: CausalLM, pool: DevicePool, batch: ForwardBatch) -> Callable[[], object]:
    return lambda: model.forward(batch, pool)


def _with_few_rows(model: CausalLM, on: bool, run: Callable[[], object]) -> Callable[[], object]:
    """``run`` with the model's blocked copies in use (``on``) or set aside (the packed
    copies then take every row count), restored after."""
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    copies = [layer.few_rows for layer in layers]
    head = model.few_rows_lm_head

    def with_setting() -> object:
        for layer, copy in zip(layers, copies, strict=True):
            layer.few_rows = copy if on else None
        model.few_rows_lm_head = head if on else None
        try:
            return run()
        finally:
            for layer, copy in zip(layers, copies, strict=True):
                layer.few_rows = copy
            model.few_rows_lm_head = head

    return with_setting


def _steps(model: CausalLM, pool: DevicePool,
           batches: list[ForwardBatch]) -> Callable[[], object]:
    return lambda: [model.forward(batch, pool) for batch in batches]


class Timing(NamedTuple):
    """Medians over the timed runs: wall seconds, and CPU seconds of the process (every
    thread's). On a machine other work shares, CPU time varies far less than wall time
    (it leaves out the time the forward's threads waited for a core, though not the
    spinning of OpenMP workers waiting at a barrier): compare settings by it there."""

    wall_s: float
    cpu_s: float


def timed_in_turns(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Each run timed ``repeats`` times, the runs in turns (a machine busier at one moment
    slows all of them alike), after one untimed warm-up each (oneDNN primitives, the
    attention kernel's build)."""
    for run in runs.values():
        run()
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            cpus[name].append(time.process_time() - cpu)
            walls[name].append(time.perf_counter() - wall)
    return {name: Timing(statistics.median(walls[name]), statistics.median(cpus[name]))
            for name in runs}


def _profiled_shares(run: Callable[[], object]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall_s = time.perf_counter() - start
    return shares_by_kind(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()),
                          wall_s)


def main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model_path or default_model_path(), "auto", None, "auto",
                       "cpu").model
    if args.few_rows == "compare" and args.no_prepack:
        raise ConfigError("--few-rows compare needs packed weights (not --no-prepack)")
    packed = False if args.no_prepack else model.prepack_weights(
        "blocked" if args.few_rows == "compare" else "auto"
    )
    config, page = model.config, args.page_size
    prompt_pages = -(-args.prompt // page)
    decode_pages = -(-(args.context + 8) // page)
    pool = DevicePool(config.kv_geometry(model.dtype),
                      max([prompt_pages] + [b * decode_pages for b in args.batch]), page)
    results = []

    def report(case: str, timing: Timing, tokens: int, flops: float,
               run: Callable[[], object]) -> None:
        seconds = timing.wall_s
        line = (f"{case}: {seconds * 1e3:.1f} ms (CPU {timing.cpu_s * 1e3:.1f} ms), "
                f"{tokens / seconds:.1f} tok/s, "
                f"GEMMs {flops / 1e9:.1f} GFLOP = {flops / seconds / 1e9:.1f} GFLOP/s overall")
        if case.startswith("decode"):
            line += f", weights read at {weight_bytes(model) / seconds / 1e9:.1f} GB/s"
        result: dict[str, object] = {"case": case, "ms": seconds * 1e3,
                                     "cpu_ms": timing.cpu_s * 1e3, "tokens": tokens,
                                     "gemm_gflop": flops / 1e9}
        if args.profile:
            shares = _profiled_shares(run)
            result["shares"] = shares
            line += "; " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
        print(line, flush=True)
        results.append(result)

    with torch.inference_mode():
        # Tokens for the cold prompt and for each decode context (either may be the longer).
        ids = [(7 * i + 1) % config.vocab_size for i in range(max(args.prompt, args.context))]
        prompts = {
            f"cold prompt {args.prompt} in chunks of {chunk or args.prompt}":
                prompt_chunks(ids[: args.prompt], torch.arange(prompt_pages), page, chunk)
            for chunk in args.chunk
        } if args.prompt > 0 else {}
        prefills = {case: _steps(model, pool, steps) for case, steps in prompts.items()}
        for case, timing in timed_in_turns(prefills, args.repeats).items():
            report(case, timing, args.prompt,
                   linear_flops(model, args.prompt, len(prompts[case])), prefills[case])
        for batch in args.batch:
            table = torch.arange(batch * decode_pages, dtype=torch.int32).view(batch, -1)
            for row in range(batch):  # fill each context's K/V once
                for step in prompt_chunks(ids[: args.context], table[row], page, 0):
                    model.forward(step, pool)
            step_of_batch = _step(model, pool, _decode_batch(table, args.context + 1, page))
            settings = {"": step_of_batch}
            if args.few_rows == "compare":
                settings = {f" over {name} weights": _with_few_rows(model, on, step_of_batch)
                            for name, on in (("blocked", True), ("packed", False))}
            timings = timed_in_turns(settings, args.repeats)
            for name, run in settings.items():
                report(f"decode B={batch} context {args.context}{name} (weights "
                       f"{weight_bytes(model) / 1e6:.0f} MB a step)", timings[name], batch,
                       linear_flops(model, batch, batch), run)
    print(f"({torch.get_num_threads()} torch threads, weights "
          f"{'prepacked' if packed else 'plain'}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "threads": torch.get_num_threads(),
                       "prepacked": packed, "loadavg": os.getloadavg()}, f, indent=2)
    return 0
