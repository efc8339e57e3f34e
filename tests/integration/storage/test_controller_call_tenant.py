"""The storage controller makes each backup's and prefetch's backend calls for its tenant
(``storage/call_tenant.py``): a backend acting per tenant (sealing, quotas) reads it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hicache.config import MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.call_tenant import current_tenant
from hicache.storage.controller import BackupOp, PrefetchOp, StorageController
from tests.integration.storage.test_clear_store import GEOMETRY, PAGE
from tests.waiting import wait_until


class RecordingBackend(FileBackend):
    """A file store noting the tenant of every set and get."""

    def __init__(self, path: Path) -> None:
        super().__init__({"path": str(path)})
        self.tenants: list[tuple[str, str | None]] = []

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self.tenants.append(("set", current_tenant()))
        return super().set(keys, host_pages)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self.tenants.append(("get", current_tenant()))
        return super().get(keys, host_pages)


def test_backups_and_reads_run_for_their_tenant(tmp_path: Path) -> None:
    host = HostPool(GEOMETRY, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = RecordingBackend(tmp_path)
    backend.attach(host)
    namespace = KeyNamespace("tenant-test", GEOMETRY.describe(), PAGE)
    keys = chain_page_keys(pack_tokens(np.arange(2 * PAGE)), PAGE, namespace.seed("acme"))
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        controller.submit_backup(BackupOp(keys, np.arange(2), tenant="acme"))
        assert controller.wait_idle(60.0)
        read = PrefetchOp(keys, tenant="acme", host_pages=np.arange(2, 4), num_existing=2)
        controller.submit_load(read)
        assert wait_until(lambda: read.io_done, 60.0)
        assert read.num_landed == 2
        controller.submit_backup(BackupOp(keys[:1], np.arange(1)))
        assert controller.wait_idle(60.0)
    finally:
        controller.stop()
        backend.close()
    assert backend.tenants == [("set", "acme"), ("get", "acme"), ("set", None)]
    assert current_tenant() is None
