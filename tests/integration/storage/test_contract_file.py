"""The contract suite against the file backend (a fresh directory per test)."""

from __future__ import annotations

from typing import Any

from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageBackend
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from tests.storage_contract import MLA_GEOMETRY, StorageContract


class TestFileContract(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return FileBackend({"path": str(store)})


class TestFileContractWithFsync(StorageContract):
    """The same contract with every page and directory synced before it is visible."""

    def make_backend(self, store: Any) -> StorageBackend:
        return FileBackend({"path": str(store), "fsync": True})


class TestFileContractMLA(TestFileContract):
    """The contract with MLA pages: one latent plane per layer."""

    geometry = MLA_GEOMETRY


class TestSealedFileContract(TestFileContract):
    """The contract with every page sealed (--l3-encryption-keys, one key for all)."""

    # Sealed frames carry a GCM tag, not a checksum: the checksum test does not apply.
    frames_pages = False

    def make_backend(self, store: Any) -> StorageBackend:
        backend = FileBackend({"path": str(store)})
        backend.use_sealer(Sealer(parse_key_file(f"* 1 {'5a' * 32}\n", "contract.keys")))
        return backend
