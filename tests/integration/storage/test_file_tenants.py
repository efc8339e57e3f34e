"""The file store per tenant: quotas evict only the tenant's own pages, TTLs expire them,
usage is counted per tenant, a purge removes one tenant's files (any instance's), and a
second instance sharing the directory learns all of it from its scan."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.file.tenant_dirs import TENANTS_DIR
from hicache.storage.backends.throttled.backend import ThrottledBackend
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.call_tenant import call_tenant
from hicache.storage.controller import BackupOp, PrefetchOp, StorageController
from hicache.storage.frame import HEADER_BYTES, SEALED_HEADER_BYTES
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from hicache.tenancy.quotas import parse_tenant_quotas
from tests.integration.storage.test_clear_store import GEOMETRY, PAGE
from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range
from tests.waiting import wait_until

NAMESPACE = KeyNamespace("tenant-quota-test", GEOMETRY.describe(), PAGE)


def keys_of(tenant: str | None, count: int, start: int = 0) -> list[bytes]:
    tokens = np.arange(start, start + count * PAGE) + 17
    return chain_page_keys(pack_tokens(tokens), PAGE, NAMESPACE.seed(tenant))


def open_store(root: Path, quotas: str | None = None) -> tuple[FileBackend, HostPool]:
    host = HostPool(GEOMETRY, 16, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = FileBackend({"path": str(root)})
    if quotas is not None:
        backend.set_tenant_quotas(parse_tenant_quotas(quotas, "quotas.txt"))
    backend.attach(host)
    return backend, host


def file_bytes(host: HostPool) -> int:
    return HEADER_BYTES + host.page_bytes


def put(backend: FileBackend, tenant: str | None, keys: list[bytes], first_page: int = 0) -> int:
    with call_tenant(tenant):
        return backend.set(keys, np.arange(first_page, first_page + len(keys)))


def stored(backend: FileBackend, tenant: str | None, keys: list[bytes]) -> list[bool]:
    with call_tenant(tenant):
        return [backend.exists([key]) == 1 for key in keys]


def test_a_tenant_over_its_quota_evicts_its_own_oldest_pages_only(tmp_path: Path) -> None:
    probe, host = open_store(tmp_path / "probe")
    page = file_bytes(host)
    probe.close()
    backend, host = open_store(tmp_path / "l3", f"acme l3={3 * page}\n")
    acme, other = keys_of("acme", 5), keys_of("other", 4)
    assert put(backend, "acme", acme[:3]) == 3
    assert put(backend, "other", other) == 4  # no quota for "other"
    with call_tenant("acme"):  # a read makes acme's first page its most recently used
        assert backend.get(acme[:1], np.arange(8, 9)) == 1
    assert put(backend, "acme", acme[3:5], first_page=3) == 2
    assert stored(backend, "acme", acme) == [True, False, False, True, True]
    assert stored(backend, "other", other) == [True] * 4
    assert backend.tenant_usage() == {"acme": 3 * page, "other": 4 * page}
    assert backend.stats().failures["evicted_tenant_quota"] == 2
    backend.check_integrity()


def test_sealed_pages_count_their_sealed_size_against_the_quota(tmp_path: Path) -> None:
    """With --l3-encryption-keys each tenant's files are sealed under its key and its quota
    counts them at their sealed size (the larger header): the quota keeps the same number
    of pages as its bytes allow, the pages read back are the ones written, and a store
    with another key for the tenant finds its pages but cannot open them."""
    keys = f"acme 1 {'a1' * 32}\n* 2 {'5a' * 32}\n"
    host = HostPool(GEOMETRY, 16, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    page = SEALED_HEADER_BYTES + host.page_bytes
    backend = FileBackend({"path": str(tmp_path)})
    backend.set_tenant_quotas(parse_tenant_quotas(f"acme l3={3 * page}\n", "quotas.txt"))
    backend.use_sealer(Sealer(parse_key_file(keys, "test.keys")))
    backend.attach(host)
    values = fill_random(host, page_range(0, 5), seed=3)
    acme = keys_of("acme", 5)
    assert put(backend, "acme", acme[:3]) == 3
    assert put(backend, "acme", acme[3:5], first_page=3) == 2
    assert stored(backend, "acme", acme) == [False, False, True, True, True]
    assert backend.tenant_usage() == {"acme": 3 * page}
    files = list(tmp_path.glob("tenants/*/??/*.?m"))
    assert len(files) == 3 and all(f.stat().st_size == page for f in files)
    with call_tenant("acme"):
        assert backend.get(acme[2:5], np.arange(10, 13)) == 3
    assert page_bytes_of(host, page_range(10, 13)) == as_bytes(values[2:5])
    backend.check_integrity()
    other = FileBackend({"path": str(tmp_path)})
    other.use_sealer(Sealer(parse_key_file(f"acme 1 {'0b' * 32}\n", "other.keys")))
    other.attach(HostPool(GEOMETRY, 4, PAGE, MemLayout.PAGE_FIRST, pin_memory=False))
    with call_tenant("acme"):
        assert other.get(acme[2:3], np.arange(1)) == 0
    assert other.stats().failures.get("bad_tag", 0) == 1
    other.close()
    backend.close()


def test_a_batch_never_evicts_its_own_pages_for_the_quota(tmp_path: Path) -> None:
    probe, host = open_store(tmp_path / "probe")
    page = file_bytes(host)
    probe.close()
    backend, _ = open_store(tmp_path / "l3", f"* l3={2 * page}\n")
    keys = keys_of("acme", 3)
    assert put(backend, "acme", keys) == 2  # the third page would evict the first
    assert stored(backend, "acme", keys) == [True, True, False]
    assert backend.stats().failures["tenant_quota_full"] == 1
    backend.check_integrity()


def test_a_tenant_never_finds_another_tenants_pages(tmp_path: Path) -> None:
    backend, host = open_store(tmp_path)
    keys = keys_of("acme", 2)
    expected = as_bytes(fill_random(host, np.arange(2), seed=3))
    assert put(backend, "acme", keys) == 2
    # The same keys asked by another tenant (a salt collision, say) are a miss: the file
    # store looks only in the calling tenant's directory.
    assert stored(backend, "other", keys) == [False, False]
    with call_tenant("other"):
        assert backend.get(keys, np.arange(4, 6)) == 0
    with call_tenant("acme"):
        assert backend.get(keys, np.arange(4, 6)) == 2
    assert as_bytes(host.pages[4:6]) == expected
    assert (tmp_path / TENANTS_DIR).is_dir()


def test_pages_past_a_tenants_ttl_are_misses_and_removed(tmp_path: Path) -> None:
    backend, host = open_store(tmp_path, "acme l3_ttl=60\n")
    acme, other = keys_of("acme", 3), keys_of("other", 1)
    assert put(backend, "acme", acme) == 3
    assert put(backend, "other", other) == 1
    old_ns = (int(os.path.getmtime(tmp_path)) - 3600) * 10**9
    for root, _, names in os.walk(tmp_path):
        for name in names:
            if name.endswith((".lm", ".tm")):
                os.utime(os.path.join(root, name), ns=(old_ns, old_ns))
    with call_tenant("acme"):
        assert backend.exists(acme) == 0
        assert backend.get(acme[1:2], np.arange(1)) == 0
    assert stored(backend, "other", other) == [True]  # no TTL for "other"
    assert backend.stats().failures["expired"] == 2
    assert backend.tenant_usage() == {"acme": file_bytes(host), "other": file_bytes(host)}
    # A restarted instance drops the rest at its scan.
    backend.close()
    again, _ = open_store(tmp_path, "acme l3_ttl=60\n")
    assert "acme" not in again.tenant_usage()
    assert again.stats().failures["expired"] == 1
    assert stored(again, "acme", acme) == [False] * 3
    assert put(again, "acme", acme) == 3  # written anew, fresh
    assert stored(again, "acme", acme) == [True] * 3


def test_usage_and_purge_are_shared_through_the_directory(tmp_path: Path) -> None:
    first, host = open_store(tmp_path)
    page = file_bytes(host)
    acme, other, plain = keys_of("acme", 3), keys_of("other", 2), keys_of(None, 2)
    assert put(first, "acme", acme) == 3
    assert put(first, "other", other) == 2
    assert put(first, None, plain) == 2
    # A second instance on the same directory knows whose every page is from its scan.
    second, _ = open_store(tmp_path)
    assert second.tenant_usage() == {"acme": 3 * page, "other": 2 * page, None: 2 * page}
    # It purges pages the first instance wrote; the others stay.
    assert second.purge_tenant("acme") == 3
    assert second.tenant_usage() == {"other": 2 * page, None: 2 * page}
    with call_tenant("acme"):  # gone for the writer too: its index learns at the read
        assert first.get(acme[:1], np.arange(1)) == 0
    assert stored(first, "acme", acme[:1]) == [False]
    assert stored(first, "other", other) == [True] * 2
    assert stored(first, None, plain) == [True] * 2
    assert first.purge_tenant(None) == 2
    assert second.get(plain, np.arange(2)) == 0
    assert stored(second, "other", other) == [True] * 2
    assert first.purge_tenant("nobody") == 0
    first.check_integrity()
    second.check_integrity()


def test_a_purge_takes_the_namespaces_nested_in_the_tenant(tmp_path: Path) -> None:
    """A salt under the tenant ("acme/s1") and an extra key inside its salt ("acme\x00e")
    go with it, whichever instance wrote them; a tenant whose name only starts with the
    same letters ("acme2") and the default tenant stay."""
    first, host = open_store(tmp_path)
    page = file_bytes(host)
    pages = {
        tenant: keys_of(tenant, 2)
        for tenant in ("acme", "acme/s1", "acme\x00e", "acme2", None)
    }
    for tenant, keys in pages.items():
        assert put(first, tenant, keys) == 2
    second, _ = open_store(tmp_path)
    assert second.purge_tenant("acme") == 6
    for tenant in ("acme", "acme/s1", "acme\x00e"):
        assert stored(second, tenant, pages[tenant]) == [False] * 2
        with call_tenant(tenant):  # gone for the writer too: its index learns at the read
            assert first.get(pages[tenant], np.arange(2)) == 0
    for backend in (first, second):
        assert stored(backend, "acme2", pages["acme2"]) == [True] * 2
        assert stored(backend, None, pages[None]) == [True] * 2
    assert second.tenant_usage() == {"acme2": 2 * page, None: 2 * page}
    # The purging instance forgets its own records of the nested namespaces too.
    assert put(first, "acme/s1", pages["acme/s1"]) == 2
    assert first.purge_tenant("acme") == 2
    assert set(first.tenant_usage()) == {"acme2", None}
    first.check_integrity()
    second.check_integrity()


def test_the_controller_purges_on_the_write_thread_and_reports_usage(tmp_path: Path) -> None:
    backend, host = open_store(tmp_path)
    page = file_bytes(host)
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        acme, other = keys_of("acme", 2), keys_of("other", 1)
        controller.submit_backup(BackupOp(acme, np.arange(2), tenant="acme"))
        controller.submit_backup(BackupOp(other, np.arange(2, 3), tenant="other"))
        assert controller.wait_idle(60.0)
        assert controller.tenant_usage() == {"acme": 2 * page, "other": page}
        # Queued behind a backup of the same tenant: both of its pages are removed.
        controller.submit_backup(BackupOp(keys_of("acme", 1, start=99), np.arange(3, 4),
                                          tenant="acme"))
        assert controller.purge_tenant("acme", 60.0) == 3
        assert controller.tenant_usage() == {"other": page}
    finally:
        controller.stop()
        backend.close()


class Unlisted(FileBackend):
    """A store that keeps the contract's default: it cannot list a tenant's pages."""

    def purge_tenant(self, tenant: str | None) -> int:
        return StorageBackend.purge_tenant(self, tenant)


def test_a_backend_that_cannot_list_a_tenant_says_so(tmp_path: Path) -> None:
    host = HostPool(GEOMETRY, 4, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = Unlisted({"path": str(tmp_path)})
    backend.attach(host)
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        with pytest.raises(StorageError, match="file cannot list a tenant's pages"):
            controller.purge_tenant("acme", 60.0)
    finally:
        controller.stop()
        backend.close()


def test_a_throttled_store_reports_and_purges_its_inner_stores_tenants(tmp_path: Path) -> None:
    host = HostPool(GEOMETRY, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = ThrottledBackend({"backend": "file", "backend_extra": {"path": str(tmp_path)}})
    backend.set_tenant_quotas(parse_tenant_quotas("acme l3=1\n", "quotas.txt"))
    backend.attach(host)
    try:
        assert put(backend.inner, "other", keys_of("other", 2)) == 2
        with call_tenant("acme"):  # a quota smaller than a page: refused by the inner store
            assert backend.set(keys_of("acme", 1), np.arange(1)) == 0
        assert backend.tenant_usage() == {"other": 2 * file_bytes(host)}
        assert backend.purge_tenant("other") == 2
        assert backend.tenant_usage() == {}
    finally:
        backend.close()


def test_a_prefetch_lookup_asks_for_its_own_tenants_pages(tmp_path: Path) -> None:
    backend, _ = open_store(tmp_path)
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        keys = keys_of("acme", 3)
        assert put(backend, "acme", keys) == 3
        queries = [PrefetchOp(keys, tenant=tenant) for tenant in ("acme", "other", None)]
        for query in queries:
            controller.submit_query(query)
        assert controller.wait_idle(60.0)
        assert [query.num_existing for query in queries] == [3, 0, 0]
    finally:
        controller.stop()
        backend.close()


class SlowPurge(FileBackend):
    """A store whose purge waits for the test to let it go."""

    def __init__(self, path: Path) -> None:
        super().__init__({"path": str(path)})
        self.release = threading.Event()

    def purge_tenant(self, tenant: str | None) -> int:
        self.release.wait(60.0)
        return super().purge_tenant(tenant)


def test_a_purge_past_its_deadline_says_so_and_finishes_in_the_background(
    tmp_path: Path,
) -> None:
    host = HostPool(GEOMETRY, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = SlowPurge(tmp_path)
    backend.attach(host)
    controller = StorageController(backend, CircuitBreaker())
    with pytest.raises(StorageError, match="L3 is not running"):
        controller.purge_tenant("acme", 1.0)
    controller.start()
    try:
        assert put(backend, "acme", keys_of("acme", 2)) == 2
        with pytest.raises(StorageError, match=r"did not finish in 0\.2 s"):
            controller.purge_tenant("acme", 0.2)
        backend.release.set()
        assert wait_until(lambda: backend.tenant_usage() == {}, 60.0)
        # The write thread is free again: backups and purges go on.
        controller.submit_backup(BackupOp(keys_of("acme", 1), np.arange(1), tenant="acme"))
        assert controller.purge_tenant("acme", 60.0) == 1
    finally:
        backend.release.set()
        controller.stop()
        backend.close()


def test_a_backup_removes_its_tenants_expired_pages_nobody_asked_for(tmp_path: Path) -> None:
    backend, host = open_store(tmp_path, "acme l3_ttl=60\n")
    stale = keys_of("acme", 2)
    assert put(backend, "acme", stale) == 2
    old_ns = (int(os.path.getmtime(tmp_path)) - 3600) * 10**9
    for root, _, names in os.walk(tmp_path):
        for name in names:
            if name.endswith((".lm", ".tm")):
                os.utime(os.path.join(root, name), ns=(old_ns, old_ns))
    assert put(backend, "acme", keys_of("acme", 1, start=500), first_page=2) == 1
    assert backend.tenant_usage() == {"acme": file_bytes(host)}  # only the fresh page
    assert backend.stats().failures["expired"] == 2
    backend.check_integrity()
