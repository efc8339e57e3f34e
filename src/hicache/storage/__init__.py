"""L3 storage: the backend contract, the built-in backends (by name) and the tier's controller.

Each built-in backend is a package of its own, ``backends/<name>/`` (``backend.py``,
then what only it uses: settings, client, wire protocol ...); the pieces they share (the
contract, the page frame, page files and regions, the options, the failure
reasons) lie here beside the controller and its breaker and deadlines.
Backends are created by name through ``create_storage_backend``, which imports
each one only when asked for, so optional client libraries (Mooncake) are
needed only by those who use them. One backend is a tool rather than a store: ``throttled``
wraps any other behind a simulated latency and bandwidth, so tests and benchmarks can make
L3 as slow as they need (slower than recomputing a prompt, say) over a real store.
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
