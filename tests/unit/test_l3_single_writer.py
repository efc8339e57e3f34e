"""MLA pages under tensor parallelism: one writer, every reader, keys without the TP layout.

Every rank of an MLA model holds the same latent, so rank 0 alone writes a page to
L3 and the others count their backup done without a call; the page keys carry no
TP rank or size, so an instance of any TP size hits the pages. The ranks here are
caches built with a ``tp_rank``/``tp_size`` over one store (the 2-process group run
is the model's end-to-end test).
"""

from __future__ import annotations

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.kv_oracle import conversation, serve, serve_with_l3, settle
from tests.storage_reference import MemoryBackend, MemoryStore
from tests.unit.test_l3_agreement import _tick

MLA = KVGeometry.mla(num_layers=2, latent_dim=6, dtype=torch.float32)
MHA = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
PAGE_SIZE = 4
TOKENS = 40
PAGES = TOKENS // PAGE_SIZE


def _rank(
    store: MemoryStore, geometry: KVGeometry, tp_rank: int, tp_size: int
) -> tuple[HierarchicalCache, MemoryBackend]:
    config = CacheConfig(
        page_size=PAGE_SIZE, enable_hierarchical_cache=True, io_backend=IOBackendKind.DIRECT,
        mem_layout=MemLayout.PAGE_FIRST, load_back_threshold_tokens=1,
    )
    cache = HierarchicalCache(config, geometry, 64, tp_rank=tp_rank, tp_size=tp_size)
    backend = MemoryBackend(store)
    storage = StorageConfig(
        backend="memory", prefetch_threshold=1, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE
    )
    cache.attach_storage(storage, backend)
    return cache, backend


def _puts(backend: MemoryBackend) -> int:
    return backend.calls.count("set")


def test_only_rank_0_writes_mla_pages_and_every_tp_size_reads_them() -> None:
    store = MemoryStore()
    ranks = [_rank(store, MLA, rank, 2) for rank in range(2)]
    readers: list[HierarchicalCache] = []
    try:
        assert [cache.writes_to_l3 for cache, _ in ranks] == [True, False]
        seeds = {cache.tree.namespace.seed(None) for cache, _ in ranks}
        assert len(seeds) == 1  # no TP rank in MLA keys
        tokens = conversation(TOKENS)
        # Rank 1 first: it finds nothing and writes nothing; then rank 0 still finds
        # nothing, and writes every page.
        for cache, _ in reversed(ranks):
            assert serve_with_l3(cache, tokens) == 0
            settle(cache)
        (rank0, backend0), (rank1, backend1) = ranks
        assert _puts(backend0) > 0 and _puts(backend1) == 0
        assert len(store.pages) == PAGES
        assert rank0.stats.num_storage_backed_up_pages == PAGES
        assert rank1.stats.num_storage_backed_up_pages == 0
        # Rank 1's backups are done: its host pages are no longer protected by them.
        assert rank1.observe_l3_progress().num_done_backups == 0
        # A fresh rank 1 of tp 2 and an instance with tp 1 both hit every page, and
        # serve() checks the KV equals cold KV.
        for tp_rank, tp_size in ((1, 2), (0, 1)):
            reader, _ = _rank(store, MLA, tp_rank, tp_size)
            readers.append(reader)
            assert serve_with_l3(reader, tokens) == TOKENS
            settle(reader)
            assert reader.stats.num_storage_hit_tokens == TOKENS
        assert len(store.pages) == PAGES
    finally:
        for cache in [*(cache for cache, _ in ranks), *readers]:
            cache.close()


def test_mha_ranks_each_write_their_own_shard() -> None:
    store = MemoryStore()
    ranks = [_rank(store, MHA, rank, 2) for rank in range(2)]
    single, _ = _rank(store, MHA, 0, 1)
    try:
        assert all(cache.writes_to_l3 for cache, _ in ranks)
        assert [cache.tree.namespace.tp_rank for cache, _ in ranks] == [0, 1]
        tokens = conversation(TOKENS)
        for cache, backend in ranks:
            serve_with_l3(cache, tokens)
            settle(cache)
            assert _puts(backend) > 0
        assert len(store.pages) == 2 * PAGES  # one set of keys per rank
        # A tp 1 instance holds all heads: none of the shards is its page.
        assert serve_with_l3(single, tokens) == 0
    finally:
        for cache, _ in ranks:
            cache.close()
        single.close()


def test_a_replicated_non_writer_acknowledges_its_backups_when_agreed() -> None:
    store = MemoryStore()
    cache, backend = _rank(store, MLA, 1, 2)
    cache.replicated = True
    try:
        serve(cache, conversation(TOKENS))
        cache.poll(wait=True)  # the device->host copies landed: backups "done" at once
        assert cache.storage is not None
        assert cache.observe_l3_progress().num_done_backups > 0
        _tick(cache)
        assert cache.observe_l3_progress().num_done_backups == 0
        assert _puts(backend) == 0 and not store.pages
        settle(cache)
    finally:
        cache.close()
