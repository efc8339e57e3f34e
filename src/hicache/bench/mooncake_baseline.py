"""The raw-Mooncake baseline of ``hicache bench storage``: the client's own batch calls, no backend.

It moves the same pages as the mooncake backend's run, in the same batches,
with the same Mooncake client (borrowed from the attached backend, so the
same memory segment and the same registered host pool), but as a plain user
of Mooncake would: one object per page holding just the payload, one
``batch_put_from`` / ``batch_get_into`` call per batch straight from and into
the host pool's pages (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` over the page's regions where the layout
does not keep a page contiguous). No frame header, no checksum, no lookup
before the put. The store is emptied of these objects before each round
(not timed), like the backend's runs, so every put really writes.

What the backend adds on top is what the comparison shows: per batch, one
``batch_is_exist`` before the put, the header slots, and hashing every page
(xxh3_128) on put and, with ``verify_checksum``, on get.

``mooncake_baseline`` has the shape of ``hicache.bench.storage.Baseline``;
register it in that module's ``BASELINES`` under "mooncake".
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import torch

from hicache.bench.storage import BaselineRun, Workload, _rounds
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.page_regions import PageRegions

LABEL = "raw Mooncake client, payload-only objects, batch_put_from / batch_get_into"
LABEL_REGIONS = (
    "raw Mooncake client, payload-only objects, batch_put_from_multi_buffers / "
    "batch_get_into_multi_buffers over the page regions"
)


def mooncake_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Time the raw client's batch puts and gets of the workload's pages (see the module doc)."""
    store = getattr(backend, "raw_store", None)
    if store is None:
        raise StorageError(
            f"the raw-Mooncake baseline needs the mooncake backend, not {backend.name}"
        )
    regions = PageRegions(workload.host)
    contiguous = regions.num_regions == 1
    prefix = f"hicache-baseline-{uuid.uuid4().hex}"
    names = [f"{prefix}-{i:06d}" for i in range(workload.num_pages)]
    source = np.asarray(workload.source).tolist()
    target = np.asarray(workload.target).tolist()
    batches = workload.batches()

    def call(method: str, keys: Sequence[str], pages: Sequence[int]) -> None:
        if contiguous:
            pointers = [regions.addresses(page)[0] for page in pages]
            codes = getattr(store, method)(list(keys), pointers, [regions.page_bytes] * len(keys))
        else:
            buffers = [regions.addresses(page) for page in pages]
            sizes = [[regions.region_bytes] * regions.num_regions] * len(keys)
            codes = getattr(store, f"{method}_multi_buffers")(list(keys), buffers, sizes)
        if method == "batch_put_from":
            bad = [int(code) for code in codes if int(code) != 0]
        else:
            bad = [int(code) for code in codes if int(code) != regions.page_bytes]
        if bad:
            raise RuntimeError(
                f"raw Mooncake {method} failed for {len(bad)} pages: codes {bad[:4]}"
            )

    def put() -> None:
        for batch in batches:
            call("batch_put_from", names[batch], source[batch])

    def get() -> None:
        for batch in batches:
            call("batch_get_into", names[batch], target[batch])

    def reset() -> None:
        for batch in batches:
            store.batch_remove(names[batch], True)

    host = workload.host
    host.pages[torch.from_numpy(np.asarray(target))] = 0
    try:
        put_s, get_s = _rounds(workload.repeats, reset, put, get)
    finally:
        reset()
    stored = host.pages[torch.from_numpy(np.asarray(source))].contiguous().view(torch.uint8)
    read = host.pages[torch.from_numpy(np.asarray(target))].contiguous().view(torch.uint8)
    if not torch.equal(stored, read):
        raise RuntimeError("raw Mooncake baseline read back different bytes")
    return BaselineRun(LABEL if contiguous else LABEL_REGIONS, put_s, get_s)
