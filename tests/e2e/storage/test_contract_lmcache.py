"""The storage contract (tests/storage_contract.py) against a real lmcache_server."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.storage.backends.lmcache.backend import LMCacheBackend
from hicache.storage.base import StorageBackend
from hicache.testing.lmcache_server import LMCacheServerProcess
from tests.lmcache_fixtures import server_fixture  # noqa: F401 - a fixture
from tests.storage_contract import StorageContract


class TestLMCacheContract(StorageContract):
    @pytest.fixture
    def store(self, lmcache_server: LMCacheServerProcess) -> Any:
        return lmcache_server.url

    def make_backend(self, store: Any) -> StorageBackend:
        return LMCacheBackend({"remote_url": store})
