"""The raw-redis-py baseline of ``hicache bench storage``: pipelined SET and MGET, no backend.

It moves the same pages as the redis backend's run, in the same batches, to the
same server (through the backend's own client and connection pool), as a plain
user of redis-py would: each page's bytes (staged contiguously before the
timing, as the file baseline does) SET under a key of its own in one pipeline
per batch, then read back with one MGET per batch, the replies kept as the
bytes objects redis-py returns. No frame header, no checksum, no EXISTS before
the SET, no copy into the host pool, no splitting of a batch by size. The
keys are deleted before each round (not timed), so every SET really writes.

What the backend adds on top is what the comparison shows: per batch, the
pipelined EXISTS before the writes, joining each page's regions and header
into one value, hashing every page (xxh3_128) on put and, with
``verify_checksum``, on get, and copying the payload into the host pages.

``redis_baseline`` has the shape of ``hicache.bench.storage.Baseline``;
register it in that module's ``BASELINES`` under "redis".
"""

from __future__ import annotations

import uuid

from hicache.bench.storage import BaselineRun, Workload, _page_bytes, _rounds
from hicache.storage.base import StorageBackend, StorageError

LABEL = "raw redis-py on the same server: pipelined SET of each page's bytes, MGET per batch"


def redis_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Time raw pipelined SETs and MGETs of the workload's pages (see the module docstring)."""
    client = getattr(backend, "raw_client", None)
    if client is None:
        raise StorageError(f"the raw-redis baseline needs the redis backend, not {backend.name}")
    prefix = f"hicache-baseline-{uuid.uuid4().hex}-"
    names = [f"{prefix}{i:06d}".encode() for i in range(workload.num_pages)]
    staged = [_page_bytes(workload.host, int(page)) for page in workload.source]
    landed: list[bytes | None] = [None] * workload.num_pages
    batches = workload.batches()

    def put() -> None:
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for name, data in zip(names[batch], staged[batch], strict=True):
                pipe.set(name, data)
            if not all(pipe.execute()):
                raise RuntimeError("raw redis-py SET refused a page")

    def get() -> None:
        for batch in batches:
            landed[batch] = client.mget(names[batch])

    def reset() -> None:
        for batch in batches:
            client.delete(*names[batch])

    try:
        put_s, get_s = _rounds(workload.repeats, reset, put, get)
    finally:
        reset()
    if landed != staged:
        raise RuntimeError("raw redis-py baseline read back different bytes")
    return BaselineRun(LABEL, put_s, get_s)
