"""The contract suite against the nixl backend (NIXL's POSIX plugin over a fresh directory).

Each kernel queue the POSIX plugin offers runs the whole contract with buffered
files; O_DIRECT runs it with a geometry whose page regions are 4096-byte
multiples (what direct I/O needs; the host pool is page aligned).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hicache.memory.geometry import KVGeometry
from hicache.storage.base import StorageBackend
from tests.nixl_fixtures import require_nixl
from tests.storage_contract import StorageContract

require_nixl()

from hicache.storage.backends.nixl.backend import NixlBackend  # noqa: E402 - after the dependency check


class TestNixlContract(StorageContract):
    """Buffered files, the plugin's own choice of queue (Linux AIO)."""

    def make_backend(self, store: Any) -> StorageBackend:
        return NixlBackend({"path": str(store)})


class TestNixlContractAio(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return NixlBackend({"path": str(store), "io_queue": "aio"})


class TestNixlContractUring(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return NixlBackend({"path": str(store), "io_queue": "uring"})


class TestNixlContractPosixAio(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return NixlBackend({"path": str(store), "io_queue": "posix_aio"})


class TestNixlContractDirectIo(StorageContract):
    """O_DIRECT: regions of 8 tokens x 512-byte rows = 4096 bytes, pages of 16 KiB."""

    geometry: ClassVar[KVGeometry] = KVGeometry(
        num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16
    )
    page_size: ClassVar[int] = 8

    def make_backend(self, store: Any) -> StorageBackend:
        return NixlBackend({"path": str(store), "direct_io": True})
