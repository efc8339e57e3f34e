"""The backend contract with every page sealed (--l3-encryption-keys) over a real
redis-server and a real mooncake_master, and what each stores: ciphertext only, which a
reader with another key takes as a miss."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import redis

import hicache.storage.backends.mooncake.backend as mooncake_module
from hicache.config import MemLayout
from hicache.radix.keys import KeyNamespace
from hicache.storage.backends.file.tenant_dirs import tenant_dir_name
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.call_tenant import call_tenant
from hicache.storage.registry import (
    BACKENDS,
    SEALING_BACKENDS,
    create_storage_backend,
    unavailable_reason,
)
from hicache.storage.seal_workers import SealWorkers
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    extra_fixture,
    master_fixture,
)
from tests.redis_fixtures import extra_fixture as redis_extra_fixture  # noqa: F401
from tests.redis_fixtures import server_fixture  # noqa: F401 - a fixture
from tests.storage_contract import (
    OpenBackend,
    StorageContract,
    as_bytes,
    fill_random,
    page_bytes_of,
    page_range,
)

KEYS = f"acme 1 {'a1' * 32}\n* 2 {'5a' * 32}\n"
OTHER_KEYS = f"acme 1 {'0b' * 32}\n* 2 {'5a' * 32}\n"


def sealed(
    backend: StorageBackend, keys: str = KEYS, workers: SealWorkers | None = None
) -> StorageBackend:
    backend.use_sealer(Sealer(parse_key_file(keys, "test.keys"), workers))
    return backend


class SealedChecks(StorageContract):
    """What a sealed backend adds to the contract (mixed into each backend's class)."""

    frames_pages = False  # a GCM tag, not a checksum, guards a sealed page

    def stored_values(
        self, backend: StorageBackend, keys: list[bytes], tenant: str | None
    ) -> list[bytes]:
        """The objects ``tenant``'s pages ``keys`` are stored as, read raw."""
        raise NotImplementedError

    def test_the_store_holds_ciphertext_that_only_the_tenants_key_opens(
        self, open_backend: OpenBackend, namespace: KeyNamespace, store: Any
    ) -> None:
        writer, host = open_backend(MemLayout.PAGE_FIRST)
        keys = self.keys(namespace, 3, salt="acme")
        values = fill_random(host, page_range(0, 3), seed=5)
        with call_tenant("acme"):
            assert writer.set(keys, page_range(0, 3)) == 3
        plain = as_bytes(values)
        page_bytes = len(plain) // 3
        for index, value in enumerate(self.stored_values(writer, keys, "acme")):
            page = plain[index * page_bytes : (index + 1) * page_bytes]
            assert len(value) == page_bytes + 64 and page[:64] not in value
        with call_tenant("acme"):
            assert writer.get(keys, page_range(10, 13)) == 3
        assert page_bytes_of(host, page_range(10, 13)) == plain
        # Another tenant (the '*' key) names other objects: a miss; another key file for
        # the same tenant finds the objects and fails their tag: a miss, counted.
        with call_tenant("globex"):
            assert writer.get(keys, page_range(20, 23)) == 0
        with call_tenant("acme"):
            assert writer.set(keys, page_range(0, 3)) == 3  # stored again
        other = sealed(self.make_plain_backend(store), OTHER_KEYS)
        other.attach(self.make_host(MemLayout.PAGE_FIRST))
        try:
            with call_tenant("acme"):
                assert other.get(keys, page_range(0, 3)) == 0
            # The first bad page ends the read; pages opened beside it (on the sealer's
            # threads) are checked, dropped and counted too.
            assert 1 <= other.stats().failures.get("bad_tag", 0) <= 3
        finally:
            other.close()

    def test_a_tenant_without_a_key_stores_nothing(
        self, namespace: KeyNamespace, store: Any
    ) -> None:
        backend = sealed(self.make_plain_backend(store), f"acme 1 {'a1' * 32}\n")
        backend.attach(self.make_host(MemLayout.PAGE_FIRST))
        try:
            keys = self.keys(namespace, 3, salt="globex")
            with call_tenant("globex"):
                assert backend.set(keys, page_range(0, 3)) == 0
                assert backend.exists(keys) == 0
            assert backend.stats().failures.get("no_key", 0) == 1
        finally:
            backend.close()

    def test_a_page_under_another_key_mid_batch_ends_the_read_there(
        self, open_backend: OpenBackend, namespace: KeyNamespace, store: Any
    ) -> None:
        """Pages opened side by side: the read still answers the pages before the first
        that fails its tag, and counts it."""
        reader, host = open_backend(MemLayout.PAGE_FIRST)
        keys = self.keys(namespace, 6, salt="acme")
        values = fill_random(host, page_range(0, 6), seed=8)
        with call_tenant("acme"):
            assert reader.set(keys[:2], page_range(0, 2)) == 2
        other = sealed(self.make_plain_backend(store), OTHER_KEYS)
        other.attach(self.make_host(MemLayout.PAGE_FIRST))
        try:
            with call_tenant("acme"):
                assert other.set(keys[2:], page_range(0, 4)) == 4
        finally:
            other.close()
        with call_tenant("acme"):
            assert reader.get(keys, page_range(10, 16)) == 2
        assert page_bytes_of(host, page_range(10, 12)) == as_bytes(values[:2])
        assert reader.stats().failures.get("bad_tag", 0) >= 1

    def test_a_missing_tail_is_counted_once(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        """The usual prefix hit: one "missing", however many pages were looked for beside
        the first missing one."""
        backend, host = open_backend(MemLayout.PAGE_FIRST)
        keys = self.keys(namespace, 6, salt="acme")
        fill_random(host, page_range(0, 2), seed=8)
        with call_tenant("acme"):
            assert backend.set(keys[:2], page_range(0, 2)) == 2
            assert backend.get(keys, page_range(10, 16)) == 2
        assert backend.stats().failures == {"missing": 1}

    def make_plain_backend(self, store: Any) -> StorageBackend:
        raise NotImplementedError

    #: The sealer's threads (None: the process's shared ones).
    seal_workers: int | None = None

    def make_backend(self, store: Any) -> StorageBackend:
        workers = None if self.seal_workers is None else SealWorkers(self.seal_workers)
        return sealed(self.make_plain_backend(store), workers=workers)


class TestSealedRedis(SealedChecks):
    @pytest.fixture
    def store(self, redis_extra: dict[str, Any]) -> Any:
        return redis_extra

    def make_plain_backend(self, store: Any) -> StorageBackend:
        return RedisBackend(store)

    def stored_values(
        self, backend: StorageBackend, keys: list[bytes], tenant: str | None
    ) -> list[bytes]:
        assert isinstance(backend, RedisBackend)
        client: redis.Redis = backend.raw_client
        return [bytes(client.get(backend.key_of(key, tenant))) for key in keys]


class TestSealedRedisOnePagePerPipeline(TestSealedRedis):
    @pytest.fixture
    def store(self, redis_extra: dict[str, Any]) -> Any:
        return {**redis_extra, "max_batch_bytes": 1}


class TestSealedMooncake(SealedChecks):
    @pytest.fixture
    def store(self, mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend) -> Any:
        return mooncake_extra

    def make_plain_backend(self, store: Any) -> StorageBackend:
        return MooncakeBackend(store)

    def stored_values(
        self, backend: StorageBackend, keys: list[bytes], tenant: str | None
    ) -> list[bytes]:
        assert isinstance(backend, MooncakeBackend)
        prefix = "" if tenant is None else tenant_dir_name(tenant) + ":"  # module docstring
        names = [f"{prefix}{key.hex()}.tm" for key in keys]
        return [bytes(backend.raw_store.get(name)) for name in names]


class TestSealedMooncakeInParts(TestSealedMooncake):
    """Sealed puts split into parts of one page per sealer thread (a staging area smaller
    than a batch), and reads opened on the helper thread in chunks."""

    seal_workers = 2

    @pytest.fixture(autouse=True)
    def small_parts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(mooncake_module, "SEAL_PART_BYTES", 1)
        monkeypatch.setattr(mooncake_module, "PIPELINE_CHUNK_BYTES", 1)


class TestSealedMooncakeInPartsSerial(TestSealedMooncakeInParts):
    """The same with one sealer thread: parts of one page, each sealed and opened inline."""

    seal_workers = 1


def test_an_instance_lending_no_memory_seals_in_transport_sized_parts(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With global_segment_size 0 every page crosses the transport to another client's
    segment (here the anchor's): sealed puts go in SEAL_PART_BYTES_REMOTE parts from a
    ring of two, and what they stored opens again. Parts shrunk to a page each, so a
    batch of five is put in five parts through both places of the ring."""
    monkeypatch.setattr(mooncake_module, "SEAL_PART_BYTES_REMOTE", 1)
    contract = TestSealedMooncake()
    host = contract.make_host(MemLayout.PAGE_FIRST)
    backend = MooncakeBackend({**mooncake_extra, "global_segment_size": 0})
    sealed(backend).attach(host)
    try:
        assert (backend._sealed_pages, backend._seal_ring) == (1, 2)
        namespace = KeyNamespace("remote-parts", contract.geometry.describe(), contract.page_size)
        keys = contract.keys(namespace, 5, seed=11, salt="acme")
        values = fill_random(host, page_range(0, 5), seed=3)
        with call_tenant("acme"):
            assert backend.set(keys, page_range(0, 5)) == 5
            assert backend.get(keys, page_range(10, 15)) == 5
        assert page_bytes_of(host, page_range(10, 15)) == as_bytes(values)
    finally:
        backend.close()


def test_start_up_knows_which_backends_seal() -> None:
    """The registry's list (what start-up refuses the flag for, without importing a
    backend) is what the backends themselves say."""
    for name, entry in BACKENDS.items():
        if unavailable_reason(name) is not None:
            continue
        backend_class = getattr(importlib.import_module(entry.module), entry.class_name)
        assert backend_class.supports_sealing == (name in SEALING_BACKENDS), name
    with pytest.raises(StorageError, match="'throttled' cannot encrypt pages"):
        create_storage_backend(
            "throttled", {"backend": "file", "backend_extra": {"path": "/nonexistent"}}
        ).use_sealer(Sealer(parse_key_file(KEYS, "k")))
