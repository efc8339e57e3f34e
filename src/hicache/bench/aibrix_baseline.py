"""The raw-AIBrix baseline of ``hicache bench storage``: its cache manager's own put/get.

It moves the same pages as the aibrix backend's run, in the same batches,
through the same AIBrix cache manager (borrowed from the attached backend:
the same L1, the same RocksDB directory, the same block size), as a plain
user of AIBrix would: ``allocate_for`` a batch of blocks, copy each page's
payload in, ``put``; ``acquire`` the blocks, copy each payload out into the
host page, release. Block names are fresh per run; no frame header, no
checksum, no lookup before the put. Each round starts from an empty store
(``clear``, not timed), like the backend's.

What the backend adds on top is what the comparison shows: the lookup of
stored pages before each put, the 48-byte header, and hashing every page
(xxh3_128) on put and, with ``verify_checksum``, on get.

``aibrix_baseline`` has the shape of ``hicache.bench.storage.Baseline``;
register it in that module's ``BASELINES`` under "aibrix".
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import torch

from hicache.bench.storage import BaselineRun, Workload, _rounds
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.page_regions import PageRegions

LABEL = "raw AIBrix cache manager: allocate_for + copy + put / acquire + copy + release"


def aibrix_baseline(workload: Workload, backend: StorageBackend) -> BaselineRun:
    """Time AIBrix's own puts and gets of the workload's pages (see the module doc)."""
    store = getattr(backend, "store", None)
    if store is None or backend.name != "aibrix":
        raise StorageError(f"the raw-AIBrix baseline needs the aibrix backend, not {backend.name}")
    regions = PageRegions(workload.host)
    prefix = uuid.uuid4().hex
    names = [f"baseline-{prefix}-{i:06d}" for i in range(workload.num_pages)]
    source = np.asarray(workload.source).tolist()
    target = np.asarray(workload.target).tolist()
    batches = workload.batches()

    def copy_in(pages: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Host pages into AIBrix's blocks."""
        for page, tensor in zip(pages, tensors, strict=True):
            regions.copy_out(page, tensor.reshape(-1).numpy().data)

    def copy_out(pages: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """AIBrix's blocks into host pages."""
        for page, tensor in zip(pages, tensors, strict=True):
            regions.copy_in(page, tensor.reshape(-1).numpy().data)

    page_tokens = workload.host.page_size

    def put() -> None:
        manager = store.manager  # clear() between rounds builds a new one
        for batch in batches:
            hashes = store.hashes(names[batch])
            want_tokens = len(names[batch]) * page_tokens
            status = manager.allocate_for(None, hashes)
            if not status.is_ok():
                raise RuntimeError(f"raw AIBrix allocate_for failed: {status}")
            handle = status.get()
            copy_in(source[batch], handle.to_tensors())
            status = manager.put(None, hashes, handle)
            if not status.is_ok() or status.get() != want_tokens:
                raise RuntimeError(f"raw AIBrix put failed: {status}")

    def get() -> None:
        manager = store.manager
        for batch in batches:
            status = manager.acquire(None, store.hashes(names[batch]))
            if not status.is_ok() or status.get()[0] != len(names[batch]) * page_tokens:
                raise RuntimeError(f"raw AIBrix acquire failed: {status}")
            handle = status.get()[1]
            try:
                copy_out(target[batch], handle.to_tensors())
            finally:
                handle.release()

    host = workload.host
    host.pages[torch.from_numpy(np.asarray(target))] = 0
    put_s, get_s = _rounds(workload.repeats, store.clear, put, get)
    store.clear()
    stored = host.pages[torch.from_numpy(np.asarray(source))].contiguous().view(torch.uint8)
    read = host.pages[torch.from_numpy(np.asarray(target))].contiguous().view(torch.uint8)
    if not torch.equal(stored, read):
        raise RuntimeError("raw AIBrix baseline read back different bytes")
    return BaselineRun(LABEL, put_s, get_s)
