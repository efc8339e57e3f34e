"""L3 storage: the backend contract, the built-in backends (by name) and the tier's controller.

Backends are created by name through ``create_storage_backend``, which imports
each one only when asked for, so optional client libraries (Mooncake) are
needed only by those who use them.
"""

from hicache.storage.base import (
    MAX_BATCH_PAGES,
    PAGE_KEY_BYTES,
    StorageBackend,
    StorageError,
    StorageStats,
    StorageUnavailableError,
)
from hicache.storage.registry import BACKENDS, create_storage_backend, unavailable_reason

__all__ = [
    "BACKENDS",
    "MAX_BATCH_PAGES",
    "PAGE_KEY_BYTES",
    "StorageBackend",
    "StorageError",
    "StorageStats",
    "StorageUnavailableError",
    "create_storage_backend",
    "unavailable_reason",
]
