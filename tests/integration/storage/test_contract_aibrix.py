"""The contract suite against the aibrix backend: a real AIBrix KVCache (L1 + RocksDB) per test.

Backends over one store (a fresh directory per test) share one AIBrix cache
manager in this process, as the contract's shared-store tests need.
"""

from __future__ import annotations

from typing import Any

from hicache.storage.base import StorageBackend
from tests.dev_dependency import require_dev_dependency
from tests.storage_contract import MLA_GEOMETRY, StorageContract

require_dev_dependency("aibrix_kvcache", "pip install 'hicache[aibrix]' (see scripts/bootstrap.sh)")

from hicache.storage.backends.aibrix.backend import AibrixBackend  # noqa: E402 - after the dependency check


class TestAibrixContract(StorageContract):
    def make_backend(self, store: Any) -> StorageBackend:
        return AibrixBackend(
            {"path": str(store), "l1_capacity": "32MiB", "timeout_per_token_ms": 1000}
        )


class TestAibrixContractWithoutL1(StorageContract):
    """RocksDB alone: every page goes straight to and from the L2."""

    def make_backend(self, store: Any) -> StorageBackend:
        # AIBrix gives a RocksDB call 20 ms per token by default; a loaded host can take
        # longer, and this suite tests answers, not pace.
        return AibrixBackend({"path": str(store), "l1": False, "timeout_per_token_ms": 1000})


class TestAibrixContractMLA(TestAibrixContract):
    """The contract with MLA pages: one latent plane per layer."""

    geometry = MLA_GEOMETRY
