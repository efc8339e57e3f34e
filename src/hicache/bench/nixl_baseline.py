"""The raw-NIXL baseline of ``hicache bench storage``: NIXL POSIX transfers of the same bytes.

It moves the same pages as the nixl backend's run, in the same batches, with
the same NIXL agent (borrowed from the attached backend: the same plugin and
kernel queue, the host pool already registered), but as a plain user of NIXL
would: one file per page holding just the payload, opened as the backend
opens them (``O_DIRECT`` when it uses it), registered, and one transfer
request per batch between the pages' regions in the pool and the files. No
frame header or trailer, no checksum, no temporaries and renames, no size
check before a read. The files are removed before each round (not timed), as
the backend's are, so every put really writes.

What the backend adds on top is what the comparison shows: hashing every page
(xxh3_128) on put and, with ``verify_checksum``, on get; a ``stat`` per page
before a put and an ``fstat`` before a get; the trailer descriptor per page;
and a rename per page.

``nixl_baseline`` has the shape of ``hicache.bench.storage.Baseline``; it is
registered in that module's ``BASELINES`` under "nixl".
"""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import torch

from hicache.bench.storage import BaselineRun, Workload, _rounds
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.page_regions import PageRegions

LABEL = "raw NIXL {plugin} transfers ({queue} queue{direct}), payload-only files, one per page"


def nixl_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Time raw NIXL batch writes and reads of the workload's pages (see the module doc)."""
    from hicache.storage.backends.nixl.backend import NixlBackend

    if not isinstance(backend, NixlBackend):
        raise StorageError(f"the raw-NIXL baseline needs the nixl backend, not {backend.name}")
    agent = backend.raw_agent
    regions = PageRegions(workload.host)
    directory = workload.work_dir / "nixl-baseline"
    directory.mkdir()
    paths = [str(directory / f"{i:06d}.page") for i in range(workload.num_pages)]
    source = np.asarray(workload.source).tolist()
    target = np.asarray(workload.target).tolist()
    settings = backend.settings
    direct = getattr(os, "O_DIRECT", 0) if settings.direct_io else 0
    file_offsets = [k * regions.region_bytes for k in range(regions.num_regions)]

    def move(op: str, flags: int, pages: list[int], batch_paths: list[str]) -> None:
        fds = [os.open(path, flags | direct, 0o644) for path in batch_paths]
        try:
            rows = len(pages) * regions.num_regions
            memory = np.zeros((rows, 3), dtype=np.uint64)
            files = np.zeros_like(memory)
            row = 0
            for page, fd in zip(pages, fds, strict=True):
                for address, offset in zip(regions.addresses(page), file_offsets, strict=True):
                    memory[row] = (address, regions.region_bytes, 0)
                    files[row] = (offset, regions.region_bytes, fd)
                    row += 1
            agent.transfer(op, memory, files, fds, regions.page_bytes, settings.transfer_timeout_s)
        finally:
            for fd in fds:
                os.close(fd)

    def put() -> None:
        for batch in workload.batches():
            move("WRITE", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, source[batch], paths[batch])

    def get() -> None:
        for batch in workload.batches():
            move("READ", os.O_RDONLY, target[batch], paths[batch])

    def reset() -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    host = workload.host
    host.pages[torch.from_numpy(np.asarray(target))] = 0
    try:
        put_s, get_s = _rounds(workload.repeats, reset, put, get)
    finally:
        reset()
    stored = host.pages[torch.from_numpy(np.asarray(source))].contiguous().view(torch.uint8)
    read = host.pages[torch.from_numpy(np.asarray(target))].contiguous().view(torch.uint8)
    if not torch.equal(stored, read):
        raise RuntimeError("raw NIXL baseline read back different bytes")
    shutil.rmtree(directory, ignore_errors=True)
    label = LABEL.format(
        plugin=settings.plugin, queue=settings.io_queue.value,
        direct=", O_DIRECT" if settings.direct_io else "",
    )
    return BaselineRun(label, put_s, get_s)
