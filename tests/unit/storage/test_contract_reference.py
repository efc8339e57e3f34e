"""The contract suite against the in-memory reference backend (the suite's own sanity check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache.storage.base import StorageBackend
from tests.storage_contract import StorageContract
from tests.storage_reference import MemoryBackend, MemoryStore


class TestReferenceContract(StorageContract):
    frames_pages = False

    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        return MemoryStore()

    def make_backend(self, store: Any) -> StorageBackend:
        assert isinstance(store, MemoryStore)
        return MemoryBackend(store)
