"""Clearing an L3 store through its controller: done, failed, too slow, or busy."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageError
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.controller import StorageController

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 4


def _backend(tmp_path: Path) -> tuple[FileBackend, HostPool, list[bytes]]:
    host = HostPool(GEOMETRY, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = FileBackend({"path": str(tmp_path)})
    backend.attach(host)
    namespace = KeyNamespace("clear-test", GEOMETRY.describe(), PAGE)
    keys = chain_page_keys(pack_tokens(np.arange(3 * PAGE)), PAGE, namespace.seed())
    assert backend.set(keys, np.arange(3)) == 3
    return backend, host, keys


def test_a_clear_removes_every_page(tmp_path: Path) -> None:
    backend, _, keys = _backend(tmp_path)
    controller = StorageController(backend, CircuitBreaker())
    assert backend.exists(keys) == 3
    controller.clear_store(60.0)
    assert backend.exists(keys) == 0
    backend.close()


def test_a_failing_clear_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _, keys = _backend(tmp_path)

    def broken() -> None:
        raise OSError("read-only file system")

    monkeypatch.setattr(backend, "clear", broken)
    with pytest.raises(StorageError, match="failed: OSError: read-only file system"):
        StorageController(backend, CircuitBreaker()).clear_store(60.0)
    assert backend.exists(keys) == 3
    backend.close()


def test_a_hung_clear_is_left_behind_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, _, _ = _backend(tmp_path)
    release = threading.Event()
    # Hangs until the test lets it go (a minute at most): far past the bound below.
    monkeypatch.setattr(backend, "clear", lambda: release.wait(60))
    began = time.monotonic()
    with pytest.raises(StorageError, match=r"did not finish in 0\.2 s"):
        StorageController(backend, CircuitBreaker()).clear_store(0.2)
    assert time.monotonic() - began < 20  # the deadline, and a busy machine's scheduling
    release.set()
    backend.close()
