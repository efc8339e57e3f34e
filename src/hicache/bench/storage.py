"""``hicache bench storage``: batch put/get throughput of L3 backends, next to a plain baseline.

Pages have the KV geometry of a model preset (default llama3-8b: 32 layers,
8 KV heads, head dim 128, bf16), or of ``--geometry`` (e.g. deepseek-v2-lite:
MLA, 27 layers of one 576-element latent, 1.9 MiB a page of 64), and
``--page-size`` tokens (default 64, so 8 MiB a Llama page). ``--num-pages``
pages of a host pool in ``--layout`` are stored (put) and read back (get) in
batches of ``--batch-pages``, through the backend's own ``set``/``get``,
exactly as the storage controller calls them.
Each round starts from an empty store (``clear``, not timed), so every put
really writes; one warm-up round, then the median of ``--repeats``. The
bytes read back are compared with the bytes stored once per backend.

Next to each backend, in the same run, a baseline moves the same bytes
without the backend (``BASELINES``). For the file backend: one plain file
per page in the same file system, written with ``os.write`` and read with
``os.readv`` from/into contiguous buffers, fsynced when the backend is
(``--fsync``); no header, checksum, rename or index. Reads of both are
served from the OS page cache when it holds the pages (nothing here drops
it), so get numbers are memory-bound rather than disk-bound unless the
pages exceed free memory. For nixl: NIXL transfers of the same pages with the
backend's own agent, one payload-only file per page (``bench/nixl_baseline.py``).

Pages are checksummed where the cache does it on a CPU device with one rank
(``memory.page_digests``): the stored pages were copied into the host pool
through the checksumming write, so puts take their checksum from there, and
gets leave the payload check to the load, which verifies it while copying.
The run also times those two copies with and without the checksum
(``bench.page_copies``), so the cost that moved there is in the same table.
``--verify-at-get`` measures the other way (what a CUDA device or tensor
parallelism does): puts hash every page and gets verify it.

Throughput is GB/s (1 GB = 1e9 B) of KV payload (headers not counted) and
pages/s; "x" is the backend's throughput over the baseline's.

``--encryption-keys FILE`` (or ``random``: one fresh key for every tenant) runs each
backend that seals (``storage.registry.SEALING_BACKENDS``) again with its pages sealed
under the file's key for the default tenant (``storage.sealing``), as
``<backend> sealed`` rows whose "x" is over the same backend in the clear: what
encryption at rest costs next to the plain path; the sealed and the plain runs alternate
(``--alternations``), each on a fresh backend, and their rounds are pooled, so that the
ratio is taken side by side. Sealed runs seal and open a batch's
pages on the sealer's threads (``storage.seal_workers``; ``--seal-threads``, 1 for the
serial path); the plain path runs on the calling thread as it always does. Sealed pages
carry no checksum, so the plain path is measured as configured (checksums in the copies,
or at put and get).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.bench import page_copies
from hicache.config import ConfigError, MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import GEOMETRY_PRESETS, KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.base import MAX_BATCH_PAGES, StorageBackend, StorageError
from hicache.storage.registry import (
    BACKENDS,
    SEALING_BACKENDS,
    create_storage_backend,
    unavailable_reason,
)
from hicache.storage.seal_workers import MAX_SEAL_WORKERS, SealWorkers, shared_seal_workers
from hicache.tenancy.keys import KeyRing, load_key_file, parse_key_file

_WARMUP = 1
_OPS = ("put", "get")
SEALED = " sealed"  # suffix of a sealed run's backend name in the results


@dataclass(frozen=True)
class Workload:
    """What every backend and baseline of one run moves."""

    geometry: KVGeometry
    host: HostPool
    keys: list[bytes]
    source: PageIds  # host pages stored by put
    target: PageIds  # host pages get reads into
    batch_pages: int
    repeats: int
    work_dir: Path  # a fresh directory of this run, removed at the end
    # The CPU device pool the stored pages came from (None with --verify-at-get).
    device: DevicePool | None = None

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.host.page_bytes

    def batches(self) -> list[slice]:
        return [
            slice(start, min(start + self.batch_pages, self.num_pages))
            for start in range(0, self.num_pages, self.batch_pages)
        ]


@dataclass(frozen=True)
class BaselineRun:
    """A baseline's timings: ``label`` says what it did."""

    label: str
    put_s: list[float]
    get_s: list[float]


@dataclass(frozen=True)
class Result:
    backend: str  # a backend name, or "<name> baseline"
    op: str
    pages: int
    bytes: int
    median_s: float
    gbps: float
    pages_per_s: float
    samples_s: list[float]


# A backend's extra config for this run, or why it cannot run here. May start
# helpers (a local Mooncake master) whose cleanup goes on the exit stack.
BackendSetup = Callable[[argparse.Namespace, Workload, contextlib.ExitStack], dict[str, Any] | str]
# The plain baseline measured next to a backend: given the workload and the
# attached backend (for its settings, or to borrow its client), time put and get.
Baseline = Callable[[Workload, StorageBackend], BaselineRun]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backends", type=str, default="file",
        help=f"comma-separated L3 backends (of {', '.join(SETUPS)}); one that cannot run "
        "here is reported as skipped",
    )
    parser.add_argument(
        "--preset", type=str, default="llama3-8b",
        help="model preset whose KV geometry gives the page shape (hicache.model.presets)",
    )
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRY_PRESETS), default=None,
        help="KV geometry by name instead of --preset's (deepseek-v2-lite: MLA pages)",
    )
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page")
    parser.add_argument("--num-pages", type=int, default=32, help="pages stored and read back")
    parser.add_argument(
        "--batch-pages", type=int, default=32,
        help=f"pages per backend call (at most {MAX_BATCH_PAGES})",
    )
    parser.add_argument(
        "--layout", type=str, default=MemLayout.PAGE_FIRST.value,
        choices=[m.value for m in MemLayout], help="host pool layout",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument(
        "--dir", type=str, default=None,
        help="where the file backend and its baseline write (a fresh subdirectory, removed "
        "after; default: the system temporary directory)",
    )
    parser.add_argument(
        "--fsync", action="store_true",
        help="file backend: fsync every page (and the baseline fsyncs its files too)",
    )
    parser.add_argument(
        "--file-direct-writes", choices=("auto", "true", "false"), default="auto",
        help="file backend: write page payloads with O_DIRECT (true), through the page cache "
        "(false), or as a server whose forward is not on the CPU does (auto: through it)",
    )
    parser.add_argument(
        "--file-direct-reads", choices=("auto", "true", "false"), default="auto",
        help="file backend: read page payloads with O_DIRECT (true), through the page cache "
        "(false), or as they are written (auto)",
    )
    parser.add_argument(
        "--mooncake-master", type=str, default=None,
        help="host:port of a running mooncake_master; without it a local one is started "
        "when the binary is installed",
    )
    parser.add_argument(
        "--mooncake-segment", choices=("local", "peer"), default="local",
        help="where mooncake pages land: local (this process lends the pool its memory, pages "
        "move by memcpy: one machine) or peer (a second process started here lends it and "
        "this one none, pages cross the transfer engine's transport as they do to another "
        "machine)",
    )
    parser.add_argument(
        "--nixl-io-queue", type=str, default="auto",
        help="nixl backend: the POSIX plugin's kernel queue (auto, aio, uring, posix_aio)",
    )
    parser.add_argument(
        "--nixl-direct-io", action="store_true",
        help="nixl backend: O_DIRECT page files (and the baseline's files too)",
    )
    parser.add_argument(
        "--redis-url", type=str, default=None,
        help="url of a running Redis or Valkey server (redis://host:port/db); without it a "
        "local redis-server is started when the binary is installed",
    )
    parser.add_argument(
        "--lmcache-url", type=str, default=None,
        help="lm://host:port of a running lmcache_server; without it a local one is started "
        "from .venv-lmcache (scripts/bootstrap.sh) when it is there",
    )
    parser.add_argument(
        "--no-verify-checksum", action="store_true",
        help="backends skip the checksum of the pages they read (verify_checksum: false; "
        "puts still hash, for the header): what verification costs, next to a default run",
    )
    parser.add_argument(
        "--verify-at-get", action="store_true",
        help="puts hash every page and gets verify it (what a CUDA device or tensor "
        "parallelism does) instead of the checksum moving into a CPU device's page copies",
    )
    parser.add_argument(
        "--encryption-keys", type=str, default=None, metavar="FILE|random",
        help="also run each backend that can with its pages sealed (AES-256-GCM) under this "
        "key file's key for the default tenant, or a fresh random key, and print sealed / "
        "plain throughput",
    )
    parser.add_argument(
        "--seal-threads", type=int, default=None, metavar="N",
        help="sealed runs: threads that seal and open a batch's pages (default: one per "
        "usable core, at most 4; 1: every page on the calling thread, the serial path)",
    )
    parser.add_argument(
        "--alternations", type=int, default=3, metavar="N",
        help="with --encryption-keys: run each backend sealed, then plain, N times over, "
        "each on a fresh backend, and pool their rounds (N * --repeats samples each)",
    )
    parser.add_argument("--json", type=str, default=None, help="write raw results here")


# ------------------------------------------------------------------ backends
def _file_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    return {
        "path": str(workload.work_dir / "file-l3"),
        "fsync": bool(args.fsync),
        "direct_writes": args.file_direct_writes,
        "direct_reads": args.file_direct_reads,
        # Room for every page (with headers) so that nothing is evicted mid-run.
        "max_bytes": 2 * workload.nbytes + (64 << 20),
    }


def _mooncake_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    reason = unavailable_reason("mooncake")
    if reason is not None:
        return reason
    # Room in the pool for every page, with headers (lent by this process or by a peer).
    segment = 2 * workload.nbytes + (64 << 20)
    extra: dict[str, Any] = {"global_segment_size": segment}
    if args.mooncake_master:
        extra["master_server_address"] = args.mooncake_master
    else:
        try:
            from hicache.testing.mooncake_master import start_master

            master = stack.enter_context(start_master())
        except Exception as error:  # no binary, or it did not come up
            return f"no --mooncake-master given and no local master could be started: {error}"
        extra["master_server_address"] = master.address
    if args.mooncake_segment == "peer":
        from hicache.testing.mooncake_peer import SegmentPeer, SegmentPeerError

        log = workload.work_dir / "mooncake-peer.log"
        try:
            stack.enter_context(SegmentPeer(extra["master_server_address"], segment, log))
        except SegmentPeerError as error:
            return f"the mooncake segment peer did not come up: {error}"
        extra["global_segment_size"] = 0  # every page goes to the peer's segment
    return extra


def _aibrix_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    reason = unavailable_reason("aibrix")
    if reason is not None:
        return reason
    # RocksDB in the run's directory; an L1 with room for every page, so gets hit it.
    return {"path": str(workload.work_dir / "aibrix-l3"), "l1_capacity": 2 * workload.nbytes}


def _nixl_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    reason = unavailable_reason("nixl")
    if reason is not None:
        return reason
    return {
        "path": str(workload.work_dir / "nixl-l3"),
        "io_queue": args.nixl_io_queue, "direct_io": bool(args.nixl_direct_io),
    }


def _redis_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    reason = unavailable_reason("redis")
    if reason is not None:
        return reason
    # Keys of this run only, removed by the backend's clear() (a shared server keeps the rest).
    extra: dict[str, Any] = {"prefix": f"hicache-bench-{uuid.uuid4().hex}:"}
    if args.redis_url:
        return {**extra, "url": args.redis_url}
    try:
        from hicache.testing.redis_server import start_redis_server

        server = stack.enter_context(start_redis_server())
    except Exception as error:  # no binary, or it did not come up
        return f"no --redis-url given and no local redis-server could be started: {error}"
    return {**extra, "url": server.url}


def _lmcache_setup(
    args: argparse.Namespace, workload: Workload, stack: contextlib.ExitStack
) -> dict[str, Any] | str:
    # Big batches of big pages: a generous socket timeout.
    extra: dict[str, Any] = {"timeout_s": 60.0, "namespace": f"bench-{uuid.uuid4().hex[:12]}"}
    if args.lmcache_url:
        return {**extra, "remote_url": args.lmcache_url}
    from hicache.testing.lmcache_server import LMCacheServerError, start_server

    try:
        server = stack.enter_context(start_server())
    except LMCacheServerError as error:
        return f"no --lmcache-url given and no local lmcache_server could be started: {error}"
    return {**extra, "remote_url": server.url}


SETUPS: dict[str, BackendSetup] = {
    "file": _file_setup, "mooncake": _mooncake_setup, "aibrix": _aibrix_setup,
    "nixl": _nixl_setup, "redis": _redis_setup, "lmcache": _lmcache_setup,
}


# ------------------------------------------------------------------ baselines
def _file_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """One plain file per page beside the backend's directory: write, (fsync,) read."""
    fsync = bool(getattr(backend, "fsync", False))
    directory = workload.work_dir / "file-baseline"
    directory.mkdir()
    page_bytes = workload.host.page_bytes
    # The same bytes, staged contiguously outside the timing (a plain store has no
    # scatter/gather: it writes what it is handed).
    staged = [_page_bytes(workload.host, int(page)) for page in workload.source]
    landing = [bytearray(page_bytes) for _ in range(workload.num_pages)]
    paths = [directory / f"{i:06d}.page" for i in range(workload.num_pages)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

    def put() -> None:
        for path, data in zip(paths, staged, strict=True):
            fd = os.open(path, flags, 0o644)
            try:
                os.write(fd, data)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def get() -> None:
        for path, buffer in zip(paths, landing, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.readv(fd, [buffer])
            finally:
                os.close(fd)

    def reset() -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    put_s, get_s = _rounds(workload.repeats, reset, put, get)
    if any(bytes(got) != want for got, want in zip(landing, staged, strict=True)):
        raise RuntimeError("file baseline read back different bytes")
    shutil.rmtree(directory, ignore_errors=True)
    label = "one plain file per page, os.write / os.readv" + (" + fsync" if fsync else "")
    return BaselineRun(label, put_s, get_s)


def _mooncake_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """The raw Mooncake client on the same bytes (``hicache.bench.mooncake_baseline``)."""
    from hicache.bench.mooncake_baseline import mooncake_baseline

    return mooncake_baseline(workload, backend)


def _nixl_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Raw NIXL POSIX transfers of the same bytes (``hicache.bench.nixl_baseline``)."""
    from hicache.bench.nixl_baseline import nixl_baseline

    return nixl_baseline(workload, backend)


def _redis_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Raw redis-py pipelined SET / MGET on the same bytes (``hicache.bench.redis_baseline``)."""
    from hicache.bench.redis_baseline import redis_baseline

    return redis_baseline(workload, backend)


def _lmcache_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Our raw client on the same server and bytes (``hicache.bench.lmcache_baseline``)."""
    from hicache.bench.lmcache_baseline import lmcache_baseline

    return lmcache_baseline(workload, backend)


def _aibrix_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """AIBrix's cache manager on the same bytes (``hicache.bench.aibrix_baseline``)."""
    from hicache.bench.aibrix_baseline import aibrix_baseline

    return aibrix_baseline(workload, backend)


# Hook: backend name -> the baseline measured next to it in the same run (a
# ``Baseline``). A backend without an entry is reported without a ratio; a
# baseline that fails is reported as skipped, the backend's numbers still stand.
BASELINES: dict[str, Baseline] = {
    "file": _file_baseline, "mooncake": _mooncake_baseline, "aibrix": _aibrix_baseline,
    "nixl": _nixl_baseline, "redis": _redis_baseline, "lmcache": _lmcache_baseline,
}


# ------------------------------------------------------------------ measuring
def _page_bytes(host: HostPool, page: int) -> bytes:
    return host.pages[page].contiguous().view(torch.uint8).numpy().tobytes()


def _rounds(
    repeats: int, reset: Callable[[], None], put: Callable[[], None], get: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Warm-up, then ``repeats`` rounds of reset (untimed), put, get."""
    put_s: list[float] = []
    get_s: list[float] = []
    for round_index in range(_WARMUP + repeats):
        reset()
        began = time.perf_counter()
        put()
        middle = time.perf_counter()
        get()
        ended = time.perf_counter()
        if round_index >= _WARMUP:
            put_s.append(middle - began)
            get_s.append(ended - middle)
    return put_s, get_s


def _measure_backend(
    workload: Workload, backend: StorageBackend
) -> tuple[list[float], list[float]]:
    keys, source, target = workload.keys, workload.source, workload.target
    batches = workload.batches()

    def put() -> None:
        for batch in batches:
            stored = backend.set(keys[batch], source[batch])
            if stored != batch.stop - batch.start:
                raise RuntimeError(
                    f"{backend.name}: set stored {stored} of {batch.stop - batch.start} pages "
                    f"(failures: {backend.stats().failures})"
                )

    def get() -> None:
        for batch in batches:
            read = backend.get(keys[batch], target[batch])
            if read != batch.stop - batch.start:
                raise RuntimeError(
                    f"{backend.name}: get read {read} of {batch.stop - batch.start} pages "
                    f"(failures: {backend.stats().failures})"
                )

    host = workload.host
    host.pages[torch.from_numpy(target)] = 0
    put_s, get_s = _rounds(workload.repeats, backend.clear, put, get)
    stored = host.pages[torch.from_numpy(source)].contiguous().view(torch.uint8)
    read = host.pages[torch.from_numpy(target)].contiguous().view(torch.uint8)
    if not torch.equal(stored, read):
        raise RuntimeError(f"{backend.name}: pages read back differ from the pages stored")
    backend.clear()
    return put_s, get_s


def _result(name: str, op: str, workload: Workload, samples: list[float]) -> Result:
    median = statistics.median(samples)
    return Result(
        name, op, workload.num_pages, workload.nbytes, median,
        workload.nbytes / median / 1e9, workload.num_pages / median, samples,
    )


def _make_workload(args: argparse.Namespace, geometry: KVGeometry, work_dir: Path) -> Workload:
    layout = MemLayout(args.layout)
    host = HostPool(geometry, 2 * args.num_pages, args.page_size, layout, pin_memory=False)
    # Random bytes in the stored pages (their values do not matter, their size does).
    source = np.arange(args.num_pages, dtype=np.int64)
    target = np.arange(args.num_pages, 2 * args.num_pages, dtype=np.int64)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(
        0, 256, (args.num_pages * host.page_bytes,), dtype=torch.uint8, generator=generator
    )
    shape = (
        args.num_pages, geometry.num_layers, geometry.kv_planes, args.page_size,
        geometry.row_elems,
    )
    data = noise.view(geometry.dtype).view(shape)
    device: DevicePool | None = None
    if args.verify_at_get:
        host.pages[torch.from_numpy(source)] = data
    else:  # as the cache on a CPU device: checksummed on the way in, verified on the way out
        device = page_copies.fill_through_device(host, source, data)
        host.digests.defer_checks = True
    # Keys of a namespace of this run only: a shared store never holds them already.
    namespace = KeyNamespace(f"bench-{uuid.uuid4().hex}", geometry.describe(), args.page_size)
    tokens = np.random.default_rng(0).integers(0, 100_000, args.num_pages * args.page_size)
    keys = chain_page_keys(pack_tokens(tokens), args.page_size, namespace.seed())
    return Workload(
        geometry, host, keys, source, target, args.batch_pages, args.repeats, work_dir, device
    )


def _run_backend(
    args: argparse.Namespace, name: str, workload: Workload, skipped: dict[str, str],
    ring: KeyRing | None = None,
) -> list[Result]:
    with contextlib.ExitStack() as stack:
        extra = SETUPS[name](args, workload, stack)
        if isinstance(extra, str):
            skipped[name] = extra
            return []
        if args.no_verify_checksum:
            extra = {**extra, "verify_checksum": False}
        # Sealed and plain runs alternate, each on a fresh backend, ``--alternations``
        # times, their rounds pooled: the ratio compares runs taken side by side, not one
        # run before the other on a machine whose speed drifts. Sealed first: the plain
        # run's reads leave the checksums the copies verify.
        sealing = ring is not None and name in SEALING_BACKENDS
        if ring is not None and not sealing:
            skipped[name + SEALED] = f"the {name} backend cannot seal pages"
        turns = args.alternations if sealing else 1
        sealed_put: list[float] = []
        sealed_get: list[float] = []
        put_s: list[float] = []
        get_s: list[float] = []
        for turn in range(turns):
            if sealing:
                assert ring is not None
                try:
                    more_put, more_get = _measure_sealed(
                        name, extra, workload, ring, args.seal_threads
                    )
                except StorageError as error:
                    skipped[name + SEALED] = str(error)
                    sealing = False
                else:
                    sealed_put += more_put
                    sealed_get += more_get
            try:
                backend = create_storage_backend(name, extra)
                backend.attach(workload.host)
            except StorageError as error:
                skipped[name] = str(error)
                return []
            last = turn + 1 == turns
            if last:  # the last turn's backend also serves the baseline below
                stack.callback(backend.close)
            try:
                more_put, more_get = _measure_backend(workload, backend)
            finally:
                if not last:
                    backend.close()
            put_s += more_put
            get_s += more_get
        sealed_results: list[Result] = []
        if sealing and sealed_put:
            sealed_results = [
                _result(name + SEALED, "put", workload, sealed_put),
                _result(name + SEALED, "get", workload, sealed_get),
            ]
        results = [
            _result(name, "put", workload, put_s), _result(name, "get", workload, get_s)
        ]
        baseline = BASELINES.get(name)
        label = f"{name} baseline"
        run: BaselineRun | None = None
        if baseline is not None:
            try:
                run = baseline(workload, backend)
            except Exception as error:  # e.g. its client library lacks a call
                skipped[label] = f"{type(error).__name__}: {error}"
        if run is not None:
            results += [
                _result(label, "put", workload, run.put_s),
                _result(label, "get", workload, run.get_s),
            ]
            print(f"{label}: {run.label}", file=sys.stderr, flush=True)
        results += sealed_results
        summary = ", ".join(f"{r.backend} {r.op} {r.gbps:.2f} GB/s" for r in results)
        print(summary, file=sys.stderr, flush=True)
        return results


def _measure_sealed(
    name: str, extra: dict[str, Any], workload: Workload, ring: KeyRing,
    threads: int | None = None,
) -> tuple[list[float], list[float]]:
    """Put and get rounds of backend ``name`` with every page sealed under ``ring``'s
    default-tenant key, on ``threads`` sealer threads (None: the engine's default)."""
    from hicache.storage.sealing import Sealer  # cryptography: loaded on use

    workers = None if threads is None else SealWorkers(threads)
    sealed = create_storage_backend(name, extra)
    sealed.use_sealer(Sealer(ring, workers))
    sealed.attach(workload.host)
    try:
        return _measure_backend(workload, sealed)
    finally:
        sealed.close()
        if workers is not None:
            workers.close()


def _key_ring(args: argparse.Namespace) -> KeyRing | None:
    """The keys of ``--encryption-keys``: a file's, or one random key for every tenant."""
    if args.encryption_keys is None:
        return None
    if args.encryption_keys == "random":
        return parse_key_file(f"* 1 {os.urandom(32).hex()}\n", "random")
    return load_key_file(args.encryption_keys)


def _measure_copies(workload: Workload) -> list[Result]:
    """The checked page copies next to plain ones (``bench.page_copies``)."""
    assert workload.device is not None
    timed = page_copies.measure_copies(
        workload.host, workload.device, workload.source, workload.target, workload.repeats
    )
    print(f"{page_copies.NAME} baseline: {page_copies.BASELINE_LABEL}", file=sys.stderr)
    results: list[Result] = []
    for kind, name in (
        ("checked", page_copies.NAME), ("unchecked", f"{page_copies.NAME} baseline"),
        ("direct", page_copies.DIRECT),
    ):
        write_s, load_s = timed[kind]
        results += [
            _result(name, "write", workload, write_s), _result(name, "load", workload, load_s)
        ]
    return results


def _print_table(args: argparse.Namespace, workload: Workload, results: list[Result]) -> None:
    geometry = workload.geometry
    page_mib = workload.host.page_bytes / 2**20
    peer = ", mooncake pages in a peer process's segment" if args.mooncake_segment == "peer" else ""
    print(
        f"hicache bench storage: {args.geometry or args.preset} KV ({geometry.describe()}), "
        f"page {args.page_size} "
        f"tokens = {page_mib:.2f} MiB, {workload.num_pages} pages ({workload.nbytes / 1e9:.3f} GB) "
        f"in batches of {workload.batch_pages}, host layout {args.layout}"
        f"{', fsync' if args.fsync else ''}"
        f"{peer}"
        f"{', reads not verified' if args.no_verify_checksum else ''}"
        f"{', checksums at put and get' if args.verify_at_get else ', checksums in the copies'}; "
        f"median of {workload.repeats}"
        + (f" (sealed and plain rows: of {workload.repeats * args.alternations}, "
           f"{args.alternations} runs each, alternating)" if args.encryption_keys else "")
    )
    print()
    print("| backend | op | GB/s | pages/s | baseline GB/s | x baseline |")
    print("|---|---|---:|---:|---:|---:|")
    by_key = {(r.backend, r.op): r for r in results}
    for r in results:
        if r.backend.endswith(" baseline"):
            continue
        # A sealed run is measured against the same backend in the clear.
        reference = r.backend[: -len(SEALED)] if r.backend.endswith(SEALED) else None
        base = by_key.get((reference or f"{r.backend} baseline", r.op))
        base_text = f"{base.gbps:.2f}" if base else "-"
        ratio = f"{r.gbps / base.gbps:.2f}" if base else "-"
        print(
            f"| {r.backend} | {r.op} | {r.gbps:.2f} | {r.pages_per_s:.0f} | {base_text} | {ratio} |"
        )
    sealed = sealed_ratios(results)
    if sealed:
        print()
        threads = args.seal_threads or shared_seal_workers().workers
        print(f"sealed / plain throughput (target >= 0.8; {threads} sealer threads, the "
              "plain path on one): " + ", ".join(
                  f"{name} {op} {ratio:.2f}x" for (name, op), ratio in sealed.items()
              ))


def sealed_ratios(results: list[Result]) -> dict[tuple[str, str], float]:
    """(backend, op) -> sealed GB/s over the same backend's plain GB/s."""
    by_key = {(r.backend, r.op): r for r in results}
    ratios: dict[tuple[str, str], float] = {}
    for r in results:
        if r.backend.endswith(SEALED):
            name = r.backend[: -len(SEALED)]
            plain = by_key.get((name, r.op))
            if plain is not None:
                ratios[(name, r.op)] = r.gbps / plain.gbps
    return ratios


def main(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETUPS]
    if unknown or not names:
        known = ", ".join(SETUPS)
        print(f"--backends: unknown {', '.join(unknown) or '(none given)'}; choose from {known}")
        return 2
    if not 1 <= args.batch_pages <= MAX_BATCH_PAGES:
        print(f"--batch-pages must be in [1, {MAX_BATCH_PAGES}], got {args.batch_pages}")
        return 2
    if min(args.num_pages, args.repeats, args.page_size, args.alternations) < 1:
        print("--num-pages, --repeats, --page-size and --alternations must be >= 1")
        return 2
    if args.seal_threads is not None and not 1 <= args.seal_threads <= MAX_SEAL_WORKERS:
        print(f"--seal-threads must be in [1, {MAX_SEAL_WORKERS}], got {args.seal_threads}")
        return 2
    if args.geometry is not None:
        geometry = GEOMETRY_PRESETS[args.geometry]
    else:
        from hicache.model.presets import PRESETS

        if args.preset not in PRESETS:
            print(f"--preset: unknown {args.preset!r}; choose from {', '.join(PRESETS)}")
            return 2
        geometry = PRESETS[args.preset].kv_geometry()
    try:
        ring = _key_ring(args)
    except ConfigError as error:
        print(error)
        return 2
    if ring is not None and ring.write_key(None) is None:
        print(f"--encryption-keys: {ring.source} has no key for the default tenant "
              "(a 'default' or '*' line): the benchmark's pages are the default tenant's")
        return 2
    parent = Path(args.dir).expanduser() if args.dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="hicache-bench-storage-", dir=parent))
    skipped: dict[str, str] = {}
    results: list[Result] = []
    try:
        workload = _make_workload(args, geometry, work_dir)
        for name in names:
            results += _run_backend(args, name, workload, skipped, ring)
        if results and workload.device is not None and not args.no_verify_checksum:
            results += _measure_copies(workload)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    _print_table(args, workload, results)
    for name, reason in skipped.items():
        print(f"\nskipped {name}: {reason}")
    if args.json:
        payload = {
            "preset": None if args.geometry else args.preset, "geometry": geometry.describe(),
            "page_size": args.page_size,
            "page_bytes": workload.host.page_bytes, "layout": args.layout,
            "batch_pages": args.batch_pages, "fsync": bool(args.fsync),
            "mooncake_segment": args.mooncake_segment,
            "verify_at_get": bool(args.verify_at_get),
            "verify_checksum": not args.no_verify_checksum,
            "repeats": args.repeats, "warmup": _WARMUP, "skipped": skipped,
            "seal_threads": args.seal_threads or shared_seal_workers().workers,
            "results": [asdict(r) for r in results],
            "sealed_over_plain": {
                f"{name} {op}": ratio for (name, op), ratio in sealed_ratios(results).items()
            },
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=1)
    return 0


assert set(SETUPS) <= set(BACKENDS), "every benchmarked backend is a registered one"
