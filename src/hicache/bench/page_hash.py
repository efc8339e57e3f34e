"""What hashing L3 pages costs the scheduler thread: the GIL, not the CPU time.

L3 threads checksum each page they write (its frame) and, where the cache's loads do
not verify it, each page they read. xxhash releases the GIL only for inputs above
64 KiB, so a page of smaller regions (layer_first with few KV heads or small pages)
hashed region by region holds the GIL for the whole hash. A scheduler thread that
drops the GIL at every torch call (as it does launching a GPU step) then waits out
each region's hash, and starves while the L3 threads run.

This hashes the same pages both ways, region by region in place and gathered whole
(``PageRegions.hash_page``: one torch copy and one xxhash call, both without the
GIL), on a thread beside a scheduler-like Python thread (a few bytecodes, then a
small torch call, in a loop). It reports the hash rate and that thread's pace beside
the hashing as a share of its pace alone (1.0: unhindered).

    hicache bench page-hash --geometry qwen3-0.6b --page-size 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from hicache.config import MemLayout
from hicache.memory.geometry import GEOMETRY_PRESETS
from hicache.memory.host_pool import HostPool
from hicache.storage.frame import checksum
from hicache.storage.page_regions import PageRegions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", choices=sorted(GEOMETRY_PRESETS), default="qwen3-0.6b",
                        help="KV geometry of the pages (default: qwen3-0.6b)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--layout", choices=[m.value for m in MemLayout],
                        default=MemLayout.LAYER_FIRST.value, help="host pool layout")
    parser.add_argument("--num-pages", type=int, default=128, help="pages hashed per pass")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median)")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")


@dataclass(frozen=True)
class Row:
    method: str
    us_per_page: float
    gb_per_s: float
    beside_pace: float  # the scheduler-like thread's pace beside the hashing / alone


class _SchedulerLike:
    """A thread looping over a few bytecodes and a small torch call (which drops the GIL),
    counting its loops until stopped."""

    def __init__(self) -> None:
        self.a = torch.ones(64)
        self.b = torch.ones(64)
        self.loops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        loops = 0
        while not self._stop.is_set():
            for _ in range(20):
                loops += 1
            torch.add(self.a, self.b)
        self.loops = loops

    def __enter__(self) -> _SchedulerLike:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _pace_alone(seconds: float) -> int:
    with _SchedulerLike() as alone:
        time.sleep(seconds)
    return alone.loops


def _timed(hash_page: Callable[[int], bytes], pages: int) -> tuple[float, float]:
    """(seconds for one pass over ``pages``, the beside thread's pace share)."""
    with _SchedulerLike() as beside:
        began = time.perf_counter()
        for page in range(pages):
            hash_page(page)
        elapsed = time.perf_counter() - began
    return elapsed, beside.loops / max(1, _pace_alone(elapsed))


def main(args: argparse.Namespace) -> int:
    geometry = GEOMETRY_PRESETS[args.geometry]
    host = HostPool(geometry, args.num_pages, args.page_size, MemLayout(args.layout),
                    pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    flat = host.flat.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
    regions = PageRegions(host)
    print(f"hicache bench page-hash: {geometry.describe()}, page {args.page_size} tokens = "
          f"{regions.page_bytes / 2**20:.2f} MiB in {regions.num_regions} region(s) of "
          f"{regions.region_bytes / 2**10:.1f} KiB, {args.layout}; gathered to hash: "
          f"{regions.gathers_to_hash}; median of {args.repeats} passes over {args.num_pages} "
          "pages")
    methods: dict[str, Callable[[int], bytes]] = {
        "regions in place": lambda page: checksum(regions.views(page)),
        "hash_page": regions.hash_page,
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for page in range(args.num_pages):  # warm-up; the two must agree
        assert methods["regions in place"](page) == regions.hash_page(page)
    for _ in range(args.repeats):  # alternated, so that both see the same machine
        for name, method in methods.items():
            samples[name].append(_timed(method, args.num_pages))
    rows = []
    for name, timed in samples.items():
        seconds = statistics.median(t for t, _ in timed)
        per_page = seconds / args.num_pages
        rows.append(Row(name, per_page * 1e6, regions.page_bytes / per_page / 1e9,
                        statistics.median(p for _, p in timed)))
    print("\n| method | us/page | GB/s | scheduler-like thread's pace beside it |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row.method} | {row.us_per_page:.1f} | {row.gb_per_s:.2f} | "
              f"{row.beside_pace:.2f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"geometry": args.geometry, "page_size": args.page_size,
                       "layout": args.layout, "rows": [asdict(r) for r in rows]}, out, indent=1)
    return 0
