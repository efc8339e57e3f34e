"""A hierarchical cache with a given L3 backend, as the cache tests of every backend build it."""

from __future__ import annotations

from typing import Any, TypeVar

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.geometry import KVGeometry
from hicache.storage.base import StorageBackend
from hicache.storage.config import PrefetchPolicy, StorageConfig

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
