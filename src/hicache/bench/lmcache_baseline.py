"""The plain-LMCache baseline of ``hicache bench storage``: the same server, the same bytes, no
backend.

It moves the workload's pages through the same ``lmcache_server`` as the
lmcache backend's run, in the same batches, with our raw client
(``hicache.storage.backends.lmcache.client``) as a plain user of the server would:
one value per page holding just its payload (sent from and received into the
page's own regions), each batch's PUTs pipelined and closed by one HEALTH
request, each batch's GETs pipelined. No frame header, no checksum, no
lookup before the put, and no generation read with lookups. The server has no
DELETE, so rounds write over the same keys (a PUT replaces the value: every
put really writes).

What the backend adds on top is what the comparison shows: per batch, one
round trip of EXIST requests before the put, the 48-byte header of every
page, and hashing every page (xxh3_128) on put and, with ``verify_checksum``,
on get.

``lmcache_baseline`` has the shape of ``hicache.bench.storage.Baseline``.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from hicache.bench.storage import BaselineRun, Workload, _rounds
from hicache.storage.backends.lmcache.client import Client
from hicache.storage.backends.lmcache.protocol import Command, encode_request, key_string
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.page_regions import PageRegions

LABEL = "raw client on the same lmcache_server, payload-only values, pipelined PUT / GET"


def lmcache_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Time raw pipelined puts and gets of the workload's pages (see the module docstring)."""
    settings = getattr(backend, "settings", None)
    if backend.name != "lmcache" or settings is None:
        raise StorageError(
            f"the plain-LMCache baseline needs the lmcache backend, not {backend.name}"
        )
    regions = PageRegions(workload.host)
    client = Client(
        settings.host, settings.port, timeout_s=max(settings.timeout_s, 60.0),
        connect_timeout_s=settings.connect_timeout_s, retry_interval_s=0.0, max_idle=1,
    )
    prefix = f"baseline-{uuid.uuid4().hex[:16]}"
    names = [key_string(prefix, i.to_bytes(8, "little")) for i in range(workload.num_pages)]
    source = np.asarray(workload.source).tolist()
    target = np.asarray(workload.target).tolist()
    batches = workload.batches()
    page_bytes = regions.page_bytes

    def put() -> None:
        with client.connection() as conn:
            for batch in batches:
                items = [
                    (names[i], regions.views(source[i])) for i in range(batch.start, batch.stop)
                ]
                conn.put(items, names[0])

    def get() -> None:
        with client.connection() as conn:
            for batch in batches:
                conn.send([encode_request(Command.GET, names[i]) for i in range(
                    batch.start, batch.stop)])
                for i in range(batch.start, batch.stop):
                    reply = conn.read_reply()
                    if not reply.ok or reply.value_bytes != page_bytes:
                        raise RuntimeError(f"raw LMCache GET of page {i} failed: {reply}")
                    conn.read_into(regions.views(target[i]))

    host = workload.host
    host.pages[torch.from_numpy(np.asarray(target))] = 0
    try:
        put_s, get_s = _rounds(workload.repeats, lambda: None, put, get)
    finally:
        client.close()
    stored = host.pages[torch.from_numpy(np.asarray(source))].contiguous().view(torch.uint8)
    read = host.pages[torch.from_numpy(np.asarray(target))].contiguous().view(torch.uint8)
    if not torch.equal(stored, read):
        raise RuntimeError("raw LMCache baseline read back different bytes")
    return BaselineRun(LABEL, put_s, get_s)
