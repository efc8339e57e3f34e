"""The contract suite against the dynamic backend, loading a store class from a test module."""

from __future__ import annotations

from typing import Any

from hicache.storage.backends.dynamic.backend import DynamicBackend
from hicache.storage.base import StorageBackend
from tests.storage_contract import MLA_GEOMETRY, StorageContract


class TestDynamicContract(StorageContract):
    frames_pages = False

    def make_backend(self, store: Any) -> StorageBackend:
        # DictStore keeps its pages in a module-level dict named by "store" (the
        # test's directory): backends made over one store share them.
        return DynamicBackend({
            "module_path": "tests.unit.storage.test_dynamic_backend",
            "class_name": "DictStore",
            "store": str(store),
        })


class TestDynamicContractMLA(TestDynamicContract):
    """The contract with MLA pages: one latent plane per layer."""

    geometry = MLA_GEOMETRY
