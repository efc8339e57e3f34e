"""``hicache bench transfer``: L2 <-> L1 page bandwidth per host layout and io backend.

With Llama-3-8B KV geometry (32 layers, 8 KV heads, head dim 128, bf16; or
another ``--geometry``, e.g. deepseek-v2-lite: MLA, 27 layers of one 576-element
latent, pages a quarter of Llama's), for each page size, host layout and io
backend, ``--pages`` scattered pages (a shuffled sample of pools twice that
size; default 1 GiB worth on CUDA) are moved:

- load: L2 -> L1, all layers in one call;
- load_layerwise: L2 -> L1, one call per layer, all layers (how prefill loads);
- store: L1 -> L2, all layers in one call.

Each is reported in GB/s (1 GB = 1e9 B) next to a contiguous pinned copy of the
same bytes (H2D for loads, D2H for stores) measured in the same run. On CUDA,
times come from CUDA events around the calls (so host-side enqueue cost counts):
warm-up, then the median of ``--repeats``. On CPU, time.perf_counter, with a
small default size so the command can be smoke-tested.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from hicache.config import IOBackendKind, MemLayout
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import GEOMETRY_PRESETS, KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import IOBackend
from hicache.transfer.direct import DirectBackend

_GIB = 1 << 30
_CPU_DEFAULT_PAGES = 8
_WARMUP = 2
_OPS = ("load", "load_layerwise", "store")
# Kernel variants by launch order (plain "kernel" picks one per host layout).
_KERNEL_ORDERS = {"kernel-page-major": False, "kernel-token-major": True}


@dataclass(frozen=True)
class Result:
    page_size: int
    layout: str  # a host layout, or "contiguous" for the baseline
    backend: str  # an io backend, or "h2d" / "d2h" for the baseline
    op: str
    bytes: int
    median_s: float
    gbps: float
    samples_s: list[float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pages", type=int, default=None,
        help=f"pages moved per op (default: 1 GiB worth on CUDA, {_CPU_DEFAULT_PAGES} on CPU)",
    )
    parser.add_argument("--page-sizes", type=str, default="16,64", help="comma-separated")
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRY_PRESETS), default="llama3-8b",
        help="KV geometry of the pools (deepseek-v2-lite: MLA, one latent per layer)",
    )
    parser.add_argument(
        "--layouts", type=str, default=",".join(m.value for m in MemLayout),
        help="comma-separated host layouts",
    )
    parser.add_argument(
        "--backends", type=str, default=",".join(k.value for k in IOBackendKind),
        help="comma-separated io backends (kernel is skipped where it cannot run); "
        f"also {', '.join(_KERNEL_ORDERS)}: the kernel with its launch order forced",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    parser.add_argument(
        "--direct-min-dma-bytes", type=int, default=None,
        help="direct backend, loads: smallest average host block moved by one DMA each "
        "(smaller: CPU gather + one DMA per chunk); 0 = always DMA; default: the backend's",
    )
    parser.add_argument("--json", type=str, default=None, help="write raw results here")
    parser.add_argument(
        "--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the device pool (L1) lives",
    )


class Timer:
    """Times a callable: CUDA events on a CUDA device, perf_counter on CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> list[float]:
        for _ in range(_WARMUP):
            fn()
        self._sync()
        samples: list[float] = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - begin)
        return samples


def _result(
    page_size: int, layout: str, backend: str, op: str, nbytes: int, samples: list[float]
) -> Result:
    median = statistics.median(samples)
    return Result(page_size, layout, backend, op, nbytes, median, nbytes / median / 1e9, samples)


def _baseline(device: torch.device, nbytes: int, page_size: int, timer: Timer) -> list[Result]:
    """One contiguous copy of ``nbytes`` each way between pinned host memory and the device."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = timer(lambda: dev.copy_(host, non_blocking=True))
    d2h = timer(lambda: host.copy_(dev, non_blocking=True))
    return [
        _result(page_size, "contiguous", "h2d", "load", nbytes, h2d),
        _result(page_size, "contiguous", "d2h", "store", nbytes, d2h),
    ]


def _make_backend(
    args: argparse.Namespace, name: str, host: HostPool, device: DevicePool
) -> IOBackend | str:
    """The backend, or why it cannot run here (no silent fallback in a benchmark)."""
    if name == IOBackendKind.DIRECT.value:
        if args.direct_min_dma_bytes is None:
            return DirectBackend(host, device)
        return DirectBackend(host, device, min_dma_bytes=args.direct_min_dma_bytes)
    from hicache.transfer.kernel import KernelBackend, kernel_unavailable_reason

    reason = kernel_unavailable_reason(host, device)
    if reason is not None:
        return reason
    return KernelBackend(host, device, token_major=_KERNEL_ORDERS.get(name))


def _measure_backend(
    io: IOBackend, host_ids: torch.Tensor, device_ids: torch.Tensor, timer: Timer
) -> dict[str, list[float]]:
    layers = io.host.geometry.num_layers

    def load_layerwise() -> None:
        for layer in range(layers):
            io.load(host_ids, device_ids, layer=layer)

    return {
        "load": timer(lambda: io.load(host_ids, device_ids)),
        "load_layerwise": timer(load_layerwise),
        "store": timer(lambda: io.store(device_ids, host_ids)),
    }


def _scattered(rng: np.random.Generator, pool_pages: int, count: int) -> torch.Tensor:
    return torch.from_numpy(rng.permutation(pool_pages)[:count].astype(np.int64))


def _run_page_size(
    args: argparse.Namespace, device: torch.device, page_size: int, timer: Timer,
    layouts: list[MemLayout], backends: list[str], skipped: dict[str, str],
) -> list[Result]:
    geometry = GEOMETRY_PRESETS[args.geometry]
    page_bytes = geometry.page_bytes(page_size)
    default_pages = _GIB // page_bytes if device.type == "cuda" else _CPU_DEFAULT_PAGES
    pages = args.pages if args.pages is not None else max(1, default_pages)
    nbytes = pages * page_bytes
    rng = np.random.default_rng(page_size)
    results = _baseline(device, nbytes, page_size, timer)
    # Pools twice the moved size, pages drawn shuffled: scattered, as after churn.
    device_pool = DevicePool(geometry, 2 * pages, page_size, device)
    for layout in layouts:
        host_pool = HostPool(geometry, 2 * pages, page_size, layout)
        host_ids = _scattered(rng, 2 * pages, pages)
        device_ids = _scattered(rng, 2 * pages, pages)
        for name in backends:
            io = _make_backend(args, name, host_pool, device_pool)
            if isinstance(io, str):
                skipped[name] = io
                continue
            measured = [
                _result(page_size, layout.value, name, op, nbytes, samples)
                for op, samples in _measure_backend(io, host_ids, device_ids, timer).items()
            ]
            results += measured
            # Progress as we go: a run cut short still shows what it measured.
            summary = ", ".join(f"{r.op} {r.gbps:.1f} GB/s" for r in measured)
            print(f"page {page_size} {layout.value} {name}: {summary}", file=sys.stderr, flush=True)
        del host_pool
    return results


def _print_table(
    results: list[Result], geometry: KVGeometry, device_name: str, repeats: int
) -> None:
    print(
        f"hicache bench transfer: {geometry.describe()} KV on {device_name}; "
        f"GB/s (1e9 B/s), median of {repeats}; x = ratio to a contiguous pinned copy"
    )
    page_sizes = sorted({r.page_size for r in results})
    for page_size in page_sizes:
        rows = [r for r in results if r.page_size == page_size]
        base = {r.op: r for r in rows if r.layout == "contiguous"}
        nbytes = rows[0].bytes
        page_bytes = geometry.page_bytes(page_size)
        print(
            f"\npage {page_size}: {nbytes // page_bytes} pages x {page_bytes / 2**20:.2f} MiB"
            f" = {nbytes / 1e9:.2f} GB per op; contiguous H2D {base['load'].gbps:.1f} GB/s,"
            f" D2H {base['store'].gbps:.1f} GB/s"
        )
        header = f"{'layout':<18} {'backend':<8}"
        for op in _OPS:
            header += f" {op:>14} {'x':>5}"
        print(header)
        cells: dict[tuple[str, str], dict[str, Result]] = {}
        for r in rows:
            if r.layout != "contiguous":
                cells.setdefault((r.layout, r.backend), {})[r.op] = r
        for (layout, backend), ops in cells.items():
            line = f"{layout:<18} {backend:<8}"
            for op in _OPS:
                result = ops[op]
                ratio = result.gbps / base["store" if op == "store" else "load"].gbps
                line += f" {result.gbps:>14.1f} {ratio:>5.2f}"
            print(line)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available; use --device cpu")
        return 2
    if args.repeats < 1:
        print("--repeats must be >= 1")
        return 2
    page_sizes = [int(p) for p in args.page_sizes.split(",") if p]
    layouts = [MemLayout(name) for name in args.layouts.split(",") if name]
    backends = [
        name if name in _KERNEL_ORDERS else IOBackendKind(name).value
        for name in args.backends.split(",")
        if name
    ]
    geometry = GEOMETRY_PRESETS[args.geometry]
    timer = Timer(device, args.repeats)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    skipped: dict[str, str] = {}
    results: list[Result] = []
    for page_size in page_sizes:
        results += _run_page_size(args, device, page_size, timer, layouts, backends, skipped)
        if args.json:  # after every page size, so a run cut short keeps its results
            _write_json(args.json, geometry, device_name, args.repeats, skipped, results)
    _print_table(results, geometry, device_name, args.repeats)
    for name, reason in skipped.items():
        print(f"\nskipped io backend {name!r}: {reason}")
    return 0


def _write_json(
    path: str, geometry: KVGeometry, device_name: str, repeats: int, skipped: dict[str, str],
    results: list[Result],
) -> None:
    payload = {
        "geometry": geometry.describe(),
        "device": device_name,
        "repeats": repeats,
        "warmup": _WARMUP,
        "skipped": skipped,
        "results": [asdict(r) for r in results],
    }
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
