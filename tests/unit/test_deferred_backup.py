"""A device->host copy that finds the host pool full is tried again at the next insert:
pages a burst inserted while the host was full (of copies of pages still on the device, or
of pages waiting for their L3 write) reach the host once room comes back, instead of being
lost at their next device eviction; one evicted meanwhile is forgotten."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig
from hicache.memory.geometry import KVGeometry
from tests.kv_oracle import conversation, serve

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 2
DEVICE_PAGES = 16
HOST_PAGES = 8


@pytest.fixture
def cache() -> Iterator[HierarchicalCache]:
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1,
    )
    built = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        yield built
    finally:
        built.close()


def evict_unheld_device_pages(cache: HierarchicalCache) -> None:
    """Every device page nothing holds leaves L1 (a copied one stays on the host)."""
    room = cache.device_pool.allocator.num_free_pages + cache.tree.num_evictable_device_pages
    cache.free_device(cache.alloc_device(room))


def fill_the_host_then_insert(cache: HierarchicalCache, deferred: list[int]) -> None:
    """Copy 8 pages to the host and keep them on the device (held), so the host is full of
    pages it may not evict; then insert ``deferred`` (4 pages), whose copy finds no room."""
    first = conversation(16, seed=1)
    serve(cache, first)
    cache.poll(wait=True)
    assert cache.host_pool is not None and cache.host_pool.allocator.num_free_pages == 0
    held = cache.acquire(first)
    serve(cache, deferred)
    cache.poll(wait=True)
    cache.release(held)
    assert cache.stats.num_backup_skipped_pages == 4
    assert cache.tree.match_prefix(deferred).num_host_tokens == 0


def test_a_copy_without_room_is_made_at_the_next_insert_once_there_is_room(
    cache: HierarchicalCache,
) -> None:
    deferred = conversation(8, seed=2)
    fill_the_host_then_insert(cache, deferred)
    # The held pages leave the device (their host copies become evictable); the deferred
    # ones stay there, held.
    held = cache.acquire(deferred)
    evict_unheld_device_pages(cache)
    assert cache.stats.num_backup_late_pages == 0  # nothing is retried before an insert
    serve(cache, conversation(4, seed=3))  # the insert that retries
    cache.poll(wait=True)
    cache.release(held)
    assert cache.stats.num_backup_late_pages == 4
    assert cache.stats.num_backup_skipped_pages == 4  # a retry is not a second skip
    # From the host alone, and the cold KV (serve checks it).
    evict_unheld_device_pages(cache)
    assert serve(cache, deferred) == 8
    cache.check_integrity()


def test_a_deferred_copy_evicted_from_the_device_first_is_forgotten(
    cache: HierarchicalCache,
) -> None:
    deferred = conversation(8, seed=2)
    fill_the_host_then_insert(cache, deferred)
    evict_unheld_device_pages(cache)  # the deferred pages had no host copy: gone
    serve(cache, conversation(4, seed=3))
    cache.poll(wait=True)
    assert cache.stats.num_backup_late_pages == 0
    assert serve(cache, deferred) == 0
    cache.check_integrity()


def test_a_flush_forgets_deferred_copies(cache: HierarchicalCache) -> None:
    deferred = conversation(8, seed=2)
    fill_the_host_then_insert(cache, deferred)
    cache.flush()
    serve(cache, conversation(4, seed=3))
    cache.poll(wait=True)
    assert cache.stats.num_backup_late_pages == 0
    cache.check_integrity()
