"""A hierarchical cache with a given L3 backend, as the cache tests of every backend build it,
and the check every backend passes: a new cache reuses the KV the last one stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.geometry import KVGeometry
from hicache.storage.base import StorageBackend
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.kv_oracle import serve_with_l3, settle

Backend = TypeVar("Backend", bound=StorageBackend)


def make_l3_cache(
    backend: str, extra: dict[str, Any], geometry: KVGeometry, *, page_size: int = 4,
    layout: MemLayout = MemLayout.PAGE_FIRST, device_pages: int = 64, **storage: Any,
) -> HierarchicalCache:
    """A write-through cache with L3 on ``backend`` (``extra`` its config), built by name
    through the registry as a server does; it prefetches from one page on and waits for
    whole prefetches. ``storage``: more ``StorageConfig`` fields, or other values of these."""
    config = CacheConfig(
        page_size=page_size, enable_hierarchical_cache=True,
        write_policy=WritePolicy.WRITE_THROUGH, io_backend=IOBackendKind.DIRECT,
        mem_layout=layout, load_back_threshold_tokens=1,
    )
    settings: dict[str, Any] = {
        "prefetch_threshold": 1, "prefetch_policy": PrefetchPolicy.WAIT_COMPLETE, **storage,
    }
    return HierarchicalCache(
        config, geometry, device_pages,
        storage=StorageConfig(backend=backend, backend_extra=extra, **settings),
    )


def l3_backend_of(cache: HierarchicalCache, kind: type[Backend]) -> Backend:
    """The cache's L3 backend, which must be a ``kind``."""
    assert cache.storage is not None, cache.storage_error
    backend = cache.storage.backend
    assert isinstance(backend, kind)
    return backend


def assert_a_new_cache_reuses(
    make_cache: Callable[[], HierarchicalCache], tokens: list[int]
) -> None:
    """One cache computes ``tokens`` and backs all their pages up; a new one on the same store
    (``make_cache`` again) gets every token from L3, writes nothing, and gets them from L3
    again after forgetting L1 and L2. The KV oracle checks every hit equals cold KV."""
    first = make_cache()
    try:
        assert serve_with_l3(first, tokens) == 0  # cold: computed, then backed up
        settle(first)
        num_pages = len(tokens) // first.config.page_size
        assert first.stats.num_storage_backed_up_pages == num_pages
        assert l3_backend_of(first, StorageBackend).stats().pages_written == num_pages
    finally:
        first.close()

    second = make_cache()
    try:
        assert serve_with_l3(second, tokens) == len(tokens)  # nothing local: all from L3
        assert second.stats.num_storage_hit_tokens == len(tokens)
        settle(second)
        backend = l3_backend_of(second, StorageBackend)
        assert backend.stats().pages_written == 0  # found, not rewritten
        second.flush()  # forget L1 and L2: L3 answers again
        assert second.tree.num_host_pages == 0
        assert serve_with_l3(second, tokens) == len(tokens)
        assert second.stats.num_storage_hit_tokens == 2 * len(tokens)
        settle(second)
        assert backend.stats().failures == {}
    finally:
        second.close()
