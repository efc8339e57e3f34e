"""The contract suite against the throttled backend wrapping the file backend, with small
delays: the wrapper changes timing only, so every page, miss and error is the file store's."""

from __future__ import annotations

from typing import Any

from hicache.storage.backends.throttled.backend import ThrottledBackend
from hicache.storage.base import StorageBackend
from tests.storage_contract import MLA_GEOMETRY, StorageContract


def throttled_file(store: Any) -> ThrottledBackend:
    return ThrottledBackend({
        "backend": "file", "backend_extra": {"path": str(store)},
        "read_latency_ms": 0.2, "read_bandwidth": "2GB",
        "write_latency_ms": 0.1, "write_bandwidth": "1GiB",
    })


class TestThrottledFileContract(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return throttled_file(store)


class TestThrottledFileContractMLA(TestThrottledFileContract):
    """The contract with MLA pages: one latent plane per layer."""

    geometry = MLA_GEOMETRY
