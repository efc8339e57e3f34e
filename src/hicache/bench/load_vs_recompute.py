"""Loading a cached prompt against computing it again: the ground truth for the choice.

One in-process engine (no HTTP); for each throttle point (an L3 read latency and
bandwidth) its L3 is a new ``throttled`` backend over a file store in a temporary directory,
and for each prompt length it answers with a few greedy tokens, repeats alternating:

- recompute: a fresh prompt of that length, nothing of it cached anywhere (its KV is
  written back to L1, L2 and L3 as usual);
- load: the same prompt again after L1 and L2 were flushed (the flush waits for the write
  back to L3 to finish), so every whole page but the one holding the last token comes from
  L3 through the throttle (``--hicache-reuse-policy load`` meanwhile);
- chosen: the same again, L1 and L2 flushed again, under the engine's own choice (policy
  ``cost``): it loads, recomputes or splits as its live cost model predicts is fastest.

``--mixed`` rows hold the prompt's first half in L2 and all of it in L3 (a request for
that half loads it back after the flush): loading the L2 half and computing the rest is a
split that can beat both pure ways when the store is slow.

A host-tier row per length does the same with only L1 flushed (a full L2 hit), at each
host point (a host->device latency and bandwidth, ``--host-points``: the engine's cache
controller loads through ``hicache.testing.throttled_io`` meanwhile; by default one
unthrottled row per length). The L3 rows load from host to device unthrottled. Each row
gives the medians, load / recompute, min(load, recompute), the choice's time over that
minimum (issue 31's target: at most 1.05), the decision the engine reported ("-": none,
as for a prompt released before its L3 lookup answered) and the tokens it took from the
tiers, and next to them what the engine's live cost model predicted just before each
timed request (the prefill of the whole prompt; the L3 read of the hit's pages and their
host->device load, or that load alone for L2, plus the tail the load still computes); "-"
while the model has not learned that cost yet.

Invariants: a load row's requests were served from the tier it names (all the hit's pages)
or the bench stops; a load's and a choice's output tokens equal the recompute's
(``same_output``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache.bench.l2_ttft import TierError, _device
from hicache.config import ReusePolicy
from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from hicache.storage.options import parse_size
from hicache.testing.throttled_io import LoadThrottle, throttle_loads, unthrottle_loads

DEFAULT_TOKENS = (1024, 2048, 4096, 8192, 16384)
# From a fast store to one slower than recompute on a CPU: (read latency ms, bandwidth).
DEFAULT_POINTS = ("2:none", "2:1GB", "2:200MB", "2:50MB", "2:10MB")
# The store's calls and the prefetch wait: far past the slowest default point's reads,
# so that a slow point is measured as slow, not cut.
PATIENT_WAITS = {"io_timeout_s": 600.0, "prefetch_timeout_max": 600.0, "prefetch_threshold": 1}
HOST_TIER = "host"
MIXED_TIER = "mixed"  # the first half of the prompt in L2, all of it in L3


@dataclass(frozen=True)
class ThrottlePoint:
    read_latency_ms: float
    read_bandwidth: str | None  # a size per second ("200MB"), None: unlimited

    @property
    def label(self) -> str:
        return self.read_bandwidth or "unlimited"


def parse_point(text: str) -> ThrottlePoint:
    """``LATENCY_MS:BANDWIDTH``; a bandwidth of ``none`` or ``unlimited`` is no limit."""
    latency, sep, bandwidth = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected LATENCY_MS:BANDWIDTH, got {text!r}")
    try:
        ms = float(latency)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"latency must be milliseconds, got {latency!r}") from e
    unlimited = bandwidth.strip().lower() in ("", "none", "unlimited", "inf")
    return ThrottlePoint(ms, None if unlimited else bandwidth.strip())


@dataclass
class Row:
    tier: str  # "storage" (a full L3 hit, throttled), "host" (a full L2 hit) or "mixed"
    tokens: int
    cached_tokens: int  # of the prompt, served by ``tier`` in each load
    # The throttle on the path the hit comes through: L3 reads for "storage", host->device
    # loads for "host"; both None: not throttled (a host row without --host-points).
    read_latency_ms: float | None
    read_bandwidth: str | None
    recompute_s: float
    load_s: float
    predicted_recompute_s: float | None
    predicted_load_s: float | None
    same_output: bool
    recompute_samples: list[float] = field(default_factory=list)
    load_samples: list[float] = field(default_factory=list)
    # The same hit again under the engine's own choice (--hicache-reuse-policy cost).
    chosen_s: float | None = None
    chosen_samples: list[float] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    chosen_same_output: bool = True
    chosen_reused: list[int] = field(default_factory=list)  # tokens the choice took from tiers

    @property
    def chosen_ratio(self) -> float | None:
        """The choice's time over the better of the two pure ways (target: <= 1.05)."""
        return None if self.chosen_s is None else self.chosen_s / self.best_s

    @property
    def ratio(self) -> float:
        return self.load_s / self.recompute_s

    @property
    def best_s(self) -> float:
        return min(self.load_s, self.recompute_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
        help="prompt lengths (default 1K-16K, capped by the model's context)",
    )
    parser.add_argument(
        "--points", type=parse_point, nargs="+", default=None,
        help="L3 throttle points LATENCY_MS:BANDWIDTH, fast to slow (bandwidth e.g. 200MB, "
        f"none: unlimited; default {' '.join(DEFAULT_POINTS)})",
    )
    parser.add_argument(
        "--host-points", type=parse_host_point, nargs="+", default=None,
        help="host->device (L2->L1) throttle points LATENCY_MS:BANDWIDTH for the L2 rows, "
        "one row per point and length (default: one unthrottled row per length)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs per point (median)")
    parser.add_argument("--output-tokens", type=int, default=2,
                        help="greedy tokens per request (compared between load and recompute)")
    parser.add_argument("--no-host-row", action="store_true", help="skip the full L2 hit rows")
    parser.add_argument(
        "--mixed", action="store_true",
        help="also, per L3 point, rows whose prompt's first half is in L2 and all of it in L3 "
        "(where loading the L2 half and computing the rest can beat both pure ways)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the rows here")
    add_engine_args(parser)
    parser.set_defaults(enable_hierarchical_cache=True, page_size=64)


def _generate(
    engine: Engine, ids: list[int], output_tokens: int
) -> tuple[GenerateOutput, list[int]]:
    """One greedy request; its last output, with every token it produced."""
    params = SamplingParams(max_new_tokens=output_tokens, temperature=0.0, ignore_eos=True)

    async def one() -> tuple[GenerateOutput, list[int]]:
        last: GenerateOutput | None = None
        tokens: list[int] = []
        async for out in engine.generate(GenerateRequest(tuple(ids), params)):
            tokens.extend(out.token_ids)
            last = out
        assert last is not None and last.finished
        return last, tokens

    return asyncio.run(one())


@dataclass
class _Timed:
    seconds: float
    tokens: list[int]
    cached: int  # prompt tokens served by the tier asked about
    decision: str | None  # the engine's load-or-recompute choice, where it made one
    reused: int  # prompt tokens served by any tier (the rest was computed)


def _timed(engine: Engine, ids: list[int], output_tokens: int, tier: str | None) -> _Timed:
    out, tokens = _generate(engine, ids, output_tokens)
    assert out.ttft_s is not None
    cached = getattr(out.cached_tokens, tier) if tier is not None else out.cached_tokens.total
    return _Timed(out.ttft_s, tokens, cached, out.reuse.decision if out.reuse else None,
                  out.cached_tokens.total)


def _set_policy(engine: Engine, policy: ReusePolicy) -> None:
    """Switch the scheduler's load-or-recompute policy between requests."""
    advisor = engine.scheduler.reuse
    engine.scheduler.call(lambda: setattr(advisor, "policy", policy)).result(60)


def _drop(engine: Engine, tier: str, ids: list[int]) -> None:
    """Leave the prompt's KV in ``tier`` alone (L2; L3 with L1 and L2 flushed; or, mixed,
    its first half in L2 and all of it in L3)."""
    if tier == HOST_TIER:
        engine.evict_device_cache()  # L2 keeps its copy
        return
    assert engine.flush_cache()  # waits for the write back to L3 first
    if tier == MIXED_TIER:
        # The first half comes back from L3 into L2 (and L1, evicted again): a later turn
        # of a conversation whose earlier part stayed in host memory.
        _set_policy(engine, ReusePolicy.LOAD)
        _generate(engine, ids[: len(ids) // 2], 1)
        engine.evict_device_cache()


def _predictions(engine: Engine, tokens: int, cached: int, tier: str) -> tuple[
    float | None, float | None
]:
    """The cost model's recompute and load seconds for this prompt, as it stands now."""
    page_size = engine.cache.page_size

    def predict() -> tuple[float | None, float | None]:
        model = engine.scheduler.cost_model
        recompute = model.predict_prefill(tokens)
        tail = model.predict_prefill(tokens - cached, context=cached)
        pages = cached // page_size
        move = model.l2_load.predict(pages)
        if tier != HOST_TIER:  # L3 lands in host memory first, then loads as an L2 hit
            storage = engine.cache.storage
            # Mixed: the first half's pages are in L2 already (what its request cached).
            reads = pages - (tokens // 2 - 1) // page_size if tier == MIXED_TIER else pages
            read = storage.read_time.predict_read(reads) if storage is not None else None
            move = None if read is None or move is None else read + move
        load = None if move is None or tail is None else move + tail
        return recompute, load

    result: tuple[float | None, float | None] = engine.scheduler.call(predict).result(60)
    return result


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def measure(
    engine: Engine, tokens: int, tier: str, point: ThrottlePoint | None, repeats: int,
    output_tokens: int, prompt: Callable[[int], list[int]],
) -> Row:
    """``repeats`` alternating (recompute, load, chosen) triples of fresh prompts of
    ``tokens``: computed cold, then loaded whole from ``tier`` (policy load), then from
    ``tier`` again under the engine's own choice (policy cost)."""
    page_size = engine.cache.page_size
    expect = (tokens - 1) // page_size * page_size  # the last token is always computed
    recompute: list[float] = []
    load: list[float] = []
    chosen: list[float] = []
    decisions: list[str] = []
    reused: list[int] = []
    predicted: list[tuple[float | None, float | None]] = []
    same = chosen_same = True
    try:
        for _ in range(repeats):
            ids = prompt(tokens)
            predicted.append(_predictions(engine, tokens, expect, tier))
            cold = _timed(engine, ids, output_tokens, None)
            if cold.cached:
                raise TierError(f"a fresh prompt found {cold.cached} cached tokens")
            served_by = None if tier == MIXED_TIER else tier  # mixed: host + storage
            _drop(engine, tier, ids)
            _set_policy(engine, ReusePolicy.LOAD)
            warm = _timed(engine, ids, output_tokens, served_by)
            if warm.cached < expect:
                raise TierError(f"expected {expect} {tier} tokens, got {warm.cached}")
            _drop(engine, tier, ids)
            _set_policy(engine, ReusePolicy.COST)
            choice = _timed(engine, ids, output_tokens, served_by)
            same = same and warm.tokens == cold.tokens
            chosen_same = chosen_same and choice.tokens == cold.tokens
            recompute.append(cold.seconds)
            load.append(warm.seconds)
            chosen.append(choice.seconds)
            decisions.append(choice.decision or "-")
            reused.append(choice.reused)
            assert engine.flush_cache()  # the next prompt starts from empty L1 and L2
    finally:
        _set_policy(engine, ReusePolicy.COST)
    return Row(
        tier, tokens, expect,
        point.read_latency_ms if point else None, point.read_bandwidth if point else None,
        recompute_s=statistics.median(recompute), load_s=statistics.median(load),
        predicted_recompute_s=_median([p[0] for p in predicted]),
        predicted_load_s=_median([p[1] for p in predicted]),
        same_output=same, recompute_samples=recompute, load_samples=load,
        chosen_s=statistics.median(chosen), chosen_samples=chosen, decisions=decisions,
        chosen_same_output=chosen_same, chosen_reused=reused,
    )


def _attach(engine: Engine, point: ThrottlePoint, path: Path) -> None:
    if engine.cache.storage is not None:
        engine.detach_storage()
    extra: dict[str, Any] = {
        **PATIENT_WAITS, "backend": "file", "backend_extra": {"path": str(path)},
        "read_latency_ms": point.read_latency_ms,
    }
    if point.read_bandwidth is not None:
        extra["read_bandwidth"] = point.read_bandwidth
    engine.attach_storage("throttled", extra, "wait_complete")


def load_throttle(point: ThrottlePoint) -> LoadThrottle:
    """A host point as the throttle of the host->device path (a bad size is refused)."""
    bandwidth = None if point.read_bandwidth is None else parse_size(point.read_bandwidth)
    return LoadThrottle(point.read_latency_ms / 1e3, bandwidth)


def parse_host_point(text: str) -> ThrottlePoint:
    """A ``--host-points`` point: ``parse_point``'s, its latency and bandwidth checked here
    (an L3 point's are checked by the throttled backend when attached)."""
    point = parse_point(text)
    try:
        load_throttle(point)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad host point {text!r}: {e}") from e
    return point


def measure_host(
    engine: Engine, point: ThrottlePoint, lengths: list[int], args: argparse.Namespace,
    prompt: Callable[[int], list[int]],
) -> list[Row]:
    """The full L2 hit rows at one host point, its throttle on the loads meanwhile."""
    controller = engine.cache.controller
    assert controller is not None  # the host tier is there (main checks)
    throttle = load_throttle(point)
    # On the scheduler's thread, between its steps: no load is being issued then.
    engine.scheduler.call(lambda: throttle_loads(controller, throttle)).result(60)
    try:
        # Warm-up: the cost model's host->device estimate learns the throttled loads.
        measure(engine, lengths[0], HOST_TIER, point, 1, args.output_tokens, prompt)
        return [
            measure(engine, n, HOST_TIER, point, args.repeats, args.output_tokens, prompt)
            for n in lengths
        ]
    finally:
        engine.scheduler.call(lambda: unthrottle_loads(controller)).result(60)


def run(engine: Engine, args: argparse.Namespace, workdir: Path) -> list[Row]:
    generator = torch.Generator().manual_seed(args.seed)
    vocab = min(engine.vocab_size, 256)  # byte ids exist in every model's vocabulary

    def prompt(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, vocab, (n,), generator=generator)]

    limit = engine.max_context_len - args.output_tokens
    lengths = sorted({t for t in args.tokens if t <= limit}) or [limit]
    points = args.points or [parse_point(p) for p in DEFAULT_POINTS]
    host_points: list[ThrottlePoint] = [] if args.no_host_row else (args.host_points or [])
    rows: list[Row] = []
    for i, point in enumerate(points):
        _attach(engine, point, workdir / f"l3-{i}")
        # Warm-up: kernels, allocator, and the new store's read estimate.
        measure(engine, lengths[0], "storage", point, 1, args.output_tokens, prompt)
        rows += [
            measure(engine, n, "storage", point, args.repeats, args.output_tokens, prompt)
            for n in lengths
        ]
        if args.mixed:
            rows += [
                measure(engine, n, MIXED_TIER, point, args.repeats, args.output_tokens, prompt)
                for n in lengths
            ]
    if args.no_host_row:
        return rows
    if not host_points:  # the host->device path at full speed, as the engine serves
        rows += [
            measure(engine, n, HOST_TIER, None, args.repeats, args.output_tokens, prompt)
            for n in lengths
        ]
    for point in host_points:
        rows += measure_host(engine, point, lengths, args, prompt)
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _decisions(names: list[str]) -> str:
    """``load`` or, where the repeats chose differently, ``load 2, split 1``."""
    counts = {name: names.count(name) for name in dict.fromkeys(names)}
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def _reused(row: Row) -> str:
    """The tokens the choice took from the tiers, of those they held (median)."""
    if not row.chosen_reused:
        return "-"
    return f"{int(statistics.median(row.chosen_reused))}/{row.cached_tokens}"


def print_table(rows: list[Row]) -> None:
    print("| tier | tokens | latency ms | bandwidth | recompute s | load s | load/recompute "
          "| min s | chosen s | chosen/min | decision | reused | predicted recompute s "
          "| predicted load s | same output |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        latency = "-" if r.read_latency_ms is None else f"{r.read_latency_ms:g}"
        bandwidth = "-" if r.read_latency_ms is None else (r.read_bandwidth or "unlimited")
        tier = {HOST_TIER: "L2", MIXED_TIER: "L2+L3"}.get(r.tier, "L3")
        ratio = "-" if r.chosen_ratio is None else f"{r.chosen_ratio:.2f}"
        same = r.same_output and r.chosen_same_output
        print(
            f"| {tier} | {r.tokens} | {latency} | {bandwidth} | {r.recompute_s:.3f} "
            f"| {r.load_s:.3f} | {r.ratio:.2f} | {r.best_s:.3f} | {_s(r.chosen_s)} | {ratio} "
            f"| {_decisions(r.decisions)} | {_reused(r)} "
            f"| {_s(r.predicted_recompute_s)} | {_s(r.predicted_load_s)} "
            f"| {'yes' if same else 'NO'} |"
        )


def main(args: argparse.Namespace) -> int:
    device = _device(args)
    if args.model_path is None and args.model_preset is None:
        from hicache.model.default_model import default_model_path

        args.model_path = str(default_model_path())  # SmolLM2, serve's default model
    if args.max_total_tokens is None:  # room for the longest prompt, twice over
        args.max_total_tokens = 2 * (max(args.tokens) + args.output_tokens + args.page_size)
    engine = build_engine(engine_config_from_args(args))
    try:
        if engine.cache.host_pool is None:
            print("load-vs-recompute needs the host tier: drop --disable-hierarchical-cache")
            return 2
        with tempfile.TemporaryDirectory(prefix="hicache-lvr-") as workdir:
            rows = run(engine, args, Path(workdir))
    finally:
        engine.shutdown()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"hicache bench load-vs-recompute: {engine.model_name} on {name}, "
        f"page {engine.cache.page_size}, L3 throttled(file)"
        f"{', L2->L1 throttled' if args.host_points and not args.no_host_row else ''}, "
        f"{args.output_tokens} output "
        f"tokens, median of {args.repeats}\n"
    )
    print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                [{**asdict(r), "ratio": r.ratio, "best_s": r.best_s,
                  "chosen_ratio": r.chosen_ratio} for r in rows], out, indent=1
            )
    return 0
