"""The "aibrix" backend: pages in AIBrix KVCache, its L1 host cache over a RocksDB L2.

AIBrix KVCache (PyPI ``aibrix-kvcache``) is the KV offloading library of the
AIBrix project. It runs inside this process: an L1 cache in host memory
(S3FIFO, LRU or FIFO eviction) in front of an L2 store, here RocksDB in a
local directory, which outlives the process. ``store`` says how our
pages map onto its blocks and block hashes.

Extra config (each key falls back to the AIBrix environment variable named;
the extra config wins):

    path                directory of the RocksDB L2 (AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT;
                        default ``$HICACHE_CACHE_DIR/aibrix``, else ``~/.cache/hicache/aibrix``)
    l1                  AIBrix's L1 host cache on or off (default true;
                        AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED)
    l1_capacity         its size, e.g. "4GiB" (default 1 GiB; AIBrix's variable
                        AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB counts GiB)
    l1_eviction_policy  S3FIFO (default), LRU or FIFO (AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY)
    l2                  the RocksDB L2 on or off (default true; off keeps pages in the
                        L1 only, lost with the process; AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND)
    ttl_s               RocksDB drops a page at a compaction once it is older than this
                        (default 600, AIBrix's; 0 keeps pages for good). AIBrix bounds its
                        RocksDB store by age only, not by size (AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S)
    timeout_per_token_ms
                        a RocksDB lookup or read of n tokens that takes longer than
                        n times this is a miss counted as "timeout" (default 20,
                        AIBrix's; AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS)
    verify_checksum     hash every page read against its header (default true)

Every page ``set`` stores goes into the L1 and on to RocksDB before the call
returns, so it survives a restart; a ``get`` the L1 misses reads RocksDB and
promotes the page into the L1 (which, with writes going through, also writes
it to RocksDB again: AIBrix's behaviour). ``exists`` asks the L1, then
RocksDB for the rest.

Pages are framed (``frame``: payload, then the 48-byte header), copied into
AIBrix's block memory on ``set`` and out of it straight into the host page on
``get``, where the header and checksum are checked. A page that fails is a
miss counted under its fault and deleted from both tiers. A failing AIBrix
call (RocksDB I/O error, timeout) is a miss counted as "io_error" or
"timeout", never an exception.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.aibrix.settings import AibrixSettings
from hicache.storage.backends.aibrix.store import (
    AibrixStore,
    BlockGeometry,
    acquire_store,
    release_store,
)
from hicache.storage.base import LookupPutBackend, PutBatch
from hicache.storage.failure_reasons import CountedReason
from hicache.storage.frame import (
    HEADER_BYTES,
    Fault,
    check_header,
    encode_header,
    object_name,
)
from hicache.storage.options import read_settings
from hicache.storage.page_regions import PageRegions


def tp_shard() -> str:
    """This process's tensor-parallel rank as a directory name ("" outside a TP group).

    Each rank is a process of its own (``hicache.distributed.group``: a process is
    in at most one torch.distributed group, its TP group) with its own KV shard, and
    RocksDB lets one process open a directory, so each rank keeps its own.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return ""
    return f"tp{dist.get_world_size()}-rank{dist.get_rank()}"


# Reasons a page read back was rejected (as opposed to not found, or a failed call).
_FAULTS = frozenset(Fault)


@dataclass
class _AibrixPut(PutBatch):
    store: AibrixStore
    regions: PageRegions
    names: list[str]


class AibrixBackend(LookupPutBackend[_AibrixPut]):
    """See the module docstring."""

    name = "aibrix"

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.settings = read_settings(AibrixSettings, self.extra_config, "aibrix storage")
        self.verify_checksum = self.settings.verify_checksum
        self._store: AibrixStore | None = None
        self._regions: PageRegions | None = None

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self._check_attachable(self._store is not None)
        regions = PageRegions(host)
        geometry = BlockGeometry(host.page_size, host.page_bytes)
        self._store = acquire_store(self.settings, geometry, tp_shard())
        super().attach(host)
        self._regions = regions

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            release_store(store)

    @property
    def store(self) -> AibrixStore:
        """The shared AIBrix store (for the bench baseline and tests)."""
        return self._ready([])[0]

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        store, regions = self._ready(keys)
        self._count_exists_query()
        if not keys:
            return 0
        found = store.exists([object_name(key, regions.order) for key in keys])
        if found.reason is not None:
            self._fail(found.reason)
        return found.count

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        store, regions = self._ready(keys, host_pages)
        if not keys:
            return 0
        began = time.perf_counter()
        pages = np.asarray(host_pages).tolist()
        names = [object_name(key, regions.order) for key in keys]
        payload_bytes = regions.page_bytes

        def land(i: int, block: np.ndarray) -> CountedReason | None:
            """Copy block ``i``'s payload into its host page; the fault, or None."""
            header = block[payload_bytes : payload_bytes + HEADER_BYTES].data
            fault = check_header(header, keys[i], regions.order, payload_bytes)
            if fault is None:
                regions.copy_in(pages[i], block.data)
                fault = regions.check_landed(header, pages[i], self.verify_checksum)
            return fault

        done = store.read(names, land)
        if done.reason is not None:
            self._fail(done.reason)
            if done.reason in _FAULTS:  # a bad page: dropped, so that a backup stores it anew
                store.delete(names[done.count : done.count + 1])
        self._count_read(done.count, payload_bytes, began)
        return done.count

    def _drop(self, keys: Sequence[bytes]) -> None:
        store, regions = self._ready(keys)
        store.delete([object_name(key, regions.order) for key in keys])

    def clear(self) -> None:
        """Remove every page of this geometry: AIBrix's L1 and its RocksDB directory."""
        store, _ = self._ready([])
        store.clear()

    # ------------------------------------------------------ put steps (set)
    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> _AibrixPut:
        store, regions = self._ready(keys, host_pages)
        return _AibrixPut(
            keys, np.asarray(host_pages).tolist(), regions.page_bytes, store, regions,
            [object_name(key, regions.order) for key in keys],
        )

    def _lookup(self, batch: _AibrixPut) -> list[bool] | None:
        return self._stored(batch.store, batch.names)

    def _put(self, batch: _AibrixPut, todo: list[int], stored: list[bool]) -> int:
        regions, keys, pages = batch.regions, batch.keys, batch.pages
        payload_bytes = regions.page_bytes

        def fill(j: int, block: np.ndarray) -> None:
            i = todo[j]
            regions.copy_out(pages[i], block.data)
            digest = regions.checksum(pages[i])
            header = encode_header(keys[i], regions.order, payload_bytes, digest)
            end = payload_bytes + HEADER_BYTES
            block[payload_bytes:end] = np.frombuffer(header, dtype=np.uint8)
            block[end:] = 0  # the padding to AIBrix's block size

        written = batch.store.write([batch.names[i] for i in todo], fill)
        if written.reason is not None:
            self._fail(written.reason)
        for i in todo[: written.count]:
            stored[i] = True
        return written.count

    # ------------------------------------------------------------ internals
    def _ready(
        self, keys: Sequence[bytes], host_pages: PageIds | None = None
    ) -> tuple[AibrixStore, PageRegions]:
        self._check_open(keys, host_pages)
        if self._store is None or self._regions is None:
            raise self._not_attached()
        return self._store, self._regions

    def _stored(self, store: AibrixStore, names: list[str]) -> list[bool]:
        """Which pages are stored already: the leading run in one call, then page by page.

        AIBrix answers a prefix count (and looks a whole sub-batch up in RocksDB
        per call); pages past the first gap (a chain stored partly before) are
        asked one at a time, so that none is rewritten.
        """
        found = store.exists(names)
        if found.reason is not None:  # cannot tell: write them all (a rewrite is harmless)
            return [False] * len(names)
        stored = [i < found.count for i in range(len(names))]
        for i in range(found.count + 1, len(names)):
            one = store.exists(names[i : i + 1])
            stored[i] = one.reason is None and one.count == 1
        return stored
