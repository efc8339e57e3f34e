"""The mooncake backend against a real mooncake_master: the contract, configuration, damage.

Damaged objects are written through the raw Mooncake client (the one the
backend uses), the way a buggy or foreign writer sharing the store would.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import hicache.storage.backends.mooncake.backend as mooncake_module
from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.net import free_port
from hicache.radix.keys import KeyNamespace
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.backends.mooncake.client import failure_reason
from hicache.storage.backends.mooncake.settings import MooncakeSettings
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from hicache.storage.options import read_settings
from hicache.storage.registry import create_storage_backend
from hicache.testing.mooncake_master import MasterProcess
from tests.listeners import listening_sockets
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    CLIENT_SIZES,
    anchor_fixture,
    extra_fixture,
    master_fixture,
)
from tests.storage_contract import (
    MLA_GEOMETRY,
    StorageContract,
    as_bytes,
    fill_random,
    page_bytes_of,
    page_range,
)


class TestMooncakeContract(StorageContract):
    @pytest.fixture
    def store(self, mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend) -> Any:
        return mooncake_extra

    def make_backend(self, store: Any) -> StorageBackend:
        return MooncakeBackend(store)


class TestMooncakeContractInChunks(TestMooncakeContract):
    """The contract again with every batch split into chunks: hashing on the helper thread
    overlaps the transfers (what large pages get; test pages are otherwise one chunk)."""

    @pytest.fixture(autouse=True)
    def small_chunks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(mooncake_module, "PIPELINE_CHUNK_BYTES", 1)


class TestMooncakeContractInPieces(TestMooncakeContract):
    """The contract again with every page handed to Mooncake in small pieces that do not
    divide its regions (what large pages get, so that copies stay in the cache)."""

    @pytest.fixture(autouse=True)
    def small_pieces(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(mooncake_module, "PAGE_PIECE_BYTES", 48)
        monkeypatch.setattr(mooncake_module, "PIPELINE_CHUNK_BYTES", 1)


class TestMooncakeContractMLA(TestMooncakeContract):
    """The contract with MLA pages: one latent plane per layer."""

    geometry = MLA_GEOMETRY


GEOMETRY_SMALL = TestMooncakeContract.geometry


# ------------------------------------------------------------------ configuration
def settings(extra: dict[str, Any]) -> MooncakeSettings:
    return read_settings(MooncakeSettings, extra, "mooncake storage")


def test_settings_default_to_a_tcp_client_on_loopback() -> None:
    got = settings({"master_server_address": "10.0.0.5:50051"})
    assert got == MooncakeSettings("10.0.0.5:50051")
    assert (got.metadata_server, got.protocol, got.local_hostname) == (
        "P2PHANDSHAKE", "tcp", "127.0.0.1",
    )
    assert got.global_segment_size == 4 * 2**30 and got.local_buffer_size == 16 * 2**20


def test_the_extra_config_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:1000")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://10.0.0.1:8080/metadata")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1GB")
    monkeypatch.setenv("MOONCAKE_DEVICE", "mlx5_0")
    from_env = settings({})
    assert from_env.master_server_address == "10.0.0.1:1000"
    assert from_env.protocol == "rdma"
    assert from_env.metadata_server == "http://10.0.0.1:8080/metadata"
    assert from_env.global_segment_size == 10**9
    assert from_env.device_name == "mlx5_0"
    mixed = settings({
        "master_server_address": "[::1]:2000", "protocol": "TCP", "global_segment_size": 4096,
        "metadata_server": "p2phandshake", "local_hostname": "10.0.0.9",
    })
    assert mixed.master_server_address == "[::1]:2000"
    assert mixed.master_host_port == ("::1", 2000)
    assert (mixed.protocol, mixed.global_segment_size) == ("tcp", 4096)
    assert mixed.metadata_server == "P2PHANDSHAKE"
    assert mixed.local_hostname == "10.0.0.9"
    assert mixed.device_name == "mlx5_0"  # not in the extra config: the environment's


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "master_server_address is required"),
        ({"master_server_address": "localhost"}, "master_server_address must be host:port"),
        ({"master_server_address": "host:99999"}, "master_server_address must be host:port"),
        ({"master_server_address": 50051}, "master_server_address must be a string"),
        ({"master_server_address": "h:1", "protocol": "udp"}, "protocol must be one of tcp, rdma"),
        ({"master_server_address": "h:1", "metadata_server": "ftp://x"}, "metadata_server"),
        ({"master_server_address": "h:1", "metadata_server": "nowhere"}, "metadata_server"),
        ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size"),
        ({"master_server_address": "h:1", "local_buffer_size": -1}, "local_buffer_size"),
        ({"master_server_address": "h:1", "local_hostname": "a b"}, "local_hostname"),
        ({"master_server_address": "h:1", "verify_checksum": "maybe"}, "verify_checksum"),
        ({"master_server_address": "h:1", "master_addr": "h:2"}, "unknown extra-config key"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        MooncakeBackend(extra)


def test_bad_settings_from_the_environment_name_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDRESS", "no-port")
    with pytest.raises(StorageError, match="MOONCAKE_MASTER_SERVER_ADDRESS"):
        MooncakeBackend({})
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDRESS", "h:1")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "12 parsecs")
    with pytest.raises(StorageError, match="MOONCAKE_LOCAL_BUFFER_SIZE"):
        MooncakeBackend({})


def test_the_registry_builds_it_by_name(mooncake_extra: dict[str, Any]) -> None:
    backend = create_storage_backend("mooncake", mooncake_extra)
    assert isinstance(backend, MooncakeBackend)
    assert backend.settings.master_server_address == mooncake_extra["master_server_address"]
    backend.close()


def test_failure_reasons_of_mooncake_codes() -> None:
    assert failure_reason(-704) == "missing"
    assert failure_reason(-900) == "unreachable"
    assert failure_reason(-200) == "no_space"
    assert failure_reason(-800) == "io_error"
    assert failure_reason(-4242) == "store_error"  # a code we do not name: a bounded label


def test_an_unreachable_master_fails_attach_at_once() -> None:
    port = free_port()  # nothing listens there
    backend = MooncakeBackend({"master_server_address": f"127.0.0.1:{port}", **CLIENT_SIZES})
    host = HostPool(GEOMETRY_SMALL, 4, 1, MemLayout.PAGE_FIRST, pin_memory=False)
    began = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=f"127.0.0.1:{port} is unreachable"):
        backend.attach(host)
    # At once: the library alone retries an unreachable master for over a minute.
    assert time.monotonic() - began < 20.0
    backend.close()


# ------------------------------------------------------------------ damaged objects
@pytest.fixture
def pair(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend
) -> Any:
    """A backend over a page_first pool, its pool, and fresh chained keys."""
    contract = TestMooncakeContract()
    host = contract.make_host(MemLayout.PAGE_FIRST)
    backend = MooncakeBackend(mooncake_extra)
    backend.attach(host)
    namespace = KeyNamespace(f"damage-{time.monotonic_ns()}", "kv", contract.page_size)
    yield backend, host, contract.keys(namespace, 6)
    backend.close()


def stored_bytes(backend: MooncakeBackend, key: bytes) -> bytes:
    data: bytes = backend.raw_store.get(object_name(key, PayloadOrder.TOKEN_MAJOR))
    assert len(data) > HEADER_BYTES
    return data


def overwrite(backend: MooncakeBackend, key: bytes, data: bytes) -> None:
    """Replace a stored object through the raw client (past the readers' lease)."""
    name = object_name(key, PayloadOrder.TOKEN_MAJOR)
    store = backend.raw_store
    assert store.remove(name, True) == 0
    assert store.put(name, data) == 0
    assert store.get_size(name) == len(data)


def damage_payload(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[5] ^= 0x40  # objects are payload || header
    return bytes(damaged)


def damage_magic(data: bytes) -> bytes:
    return data[:-HEADER_BYTES] + b"XXXX" + data[-HEADER_BYTES + 4 :]


@pytest.mark.parametrize("piece_bytes", [mooncake_module.PAGE_PIECE_BYTES, 48])
@pytest.mark.parametrize("chunk_bytes", [mooncake_module.PIPELINE_CHUNK_BYTES, 1])
@pytest.mark.parametrize(
    ("reason", "damage"),
    [
        ("corrupt", damage_payload),
        ("short_read", lambda data: data[:-7]),
        ("wrong_length", lambda data: data + b"\0" * 64),
        ("bad_magic", damage_magic),
    ],
)
def test_a_damaged_object_is_a_miss_counted_and_removed(
    pair: Any, reason: str, damage: Any, chunk_bytes: int, piece_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mooncake_module, "PIPELINE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(mooncake_module, "PAGE_PIECE_BYTES", piece_bytes)
    backend, host, keys = pair
    values = fill_random(host, page_range(0, 6), seed=1)
    assert backend.set(keys, page_range(0, 6)) == 6
    overwrite(backend, keys[3], damage(stored_bytes(backend, keys[3])))
    assert backend.exists(keys) == 6  # the damage only shows when read
    assert backend.get(keys, page_range(10, 16)) == 3
    assert page_bytes_of(host, page_range(10, 13)) == as_bytes(values[:3])
    assert backend.stats().failures == {reason: 1}
    hashing = any(t.name.startswith("hicache-mooncake-hash") for t in threading.enumerate())
    assert hashing == (chunk_bytes == 1)  # tiny chunks: pages were checked on the helper
    # The bad object is gone, so the next backup stores the page again.
    assert backend.exists(keys) == 3
    assert backend.set(keys, page_range(0, 6)) == 6
    assert backend.stats().pages_written == 7
    assert backend.get(keys, page_range(10, 16)) == 6
    assert page_bytes_of(host, page_range(10, 16)) == as_bytes(values)


def test_another_pages_object_under_this_name_is_a_wrong_key(pair: Any) -> None:
    backend, host, keys = pair
    fill_random(host, page_range(0, 6), seed=2)
    assert backend.set(keys, page_range(0, 6)) == 6
    # A valid object of page 1 stored under page 2's name (a misdirected write).
    overwrite(backend, keys[2], stored_bytes(backend, keys[1]))
    assert backend.get(keys, page_range(10, 16)) == 2
    assert backend.stats().failures == {"wrong_key": 1}
    assert backend.exists(keys) == 2


def test_without_checksum_verification_only_the_header_is_checked(
    mooncake_extra: dict[str, Any], pair: Any
) -> None:
    writer, host, keys = pair
    values = fill_random(host, page_range(0, 6), seed=3)
    assert writer.set(keys, page_range(0, 6)) == 6
    overwrite(writer, keys[4], damage_payload(stored_bytes(writer, keys[4])))
    trusting = MooncakeBackend({**mooncake_extra, "verify_checksum": False})
    trusting.attach(host)
    try:
        assert trusting.get(keys, page_range(20, 26)) == 6  # the flipped bit goes unseen
        got = host.pages[torch.from_numpy(page_range(20, 26))]
        assert not torch.equal(got, values)
        assert as_bytes(got[:4]) == as_bytes(values[:4])
    finally:
        trusting.close()
    assert writer.get(keys, page_range(30, 36)) == 4  # the verifying reader catches it
    assert writer.stats().failures == {"corrupt": 1}


def test_a_page_another_instance_is_still_writing_or_lost_is_a_miss(pair: Any) -> None:
    backend, host, keys = pair
    fill_random(host, page_range(0, 6), seed=4)
    assert backend.set(keys[:3], page_range(0, 3)) == 3
    assert backend.raw_store.remove(object_name(keys[1], PayloadOrder.TOKEN_MAJOR), True) == 0
    assert backend.get(keys[:3], page_range(10, 13)) == 1
    assert backend.stats().failures == {"missing": 1}


def test_two_backends_in_one_process_share_one_client(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend
) -> None:
    host = HostPool(GEOMETRY_SMALL, 8, 4, MemLayout.LAYER_FIRST, pin_memory=False)
    backend = MooncakeBackend(mooncake_extra)
    backend.attach(host)
    try:
        assert backend.raw_store is mooncake_anchor.raw_store
        with pytest.raises(StorageError, match="already attached"):
            backend.attach(host)
    finally:
        backend.close()
    # The anchor's registration and client survive the other backend's close.
    anchor_host = mooncake_anchor.host
    anchor_host.pages[:] = 1.5
    keys = [bytes([7]) * 16, bytes([8]) * 16]
    assert mooncake_anchor.set(keys, np.arange(2)) == 2
    assert mooncake_anchor.get(keys, np.arange(2, 4)) == 2
    mooncake_anchor.clear()


def test_the_master_listens_on_loopback_only(mooncake_master: MasterProcess) -> None:
    assert mooncake_master.running and mooncake_master.pid is not None
    listening = listening_sockets(mooncake_master.pid)
    ports = {port for _, port in listening}
    assert {mooncake_master.rpc_port, mooncake_master.metrics_port} <= ports, listening
    assert all(address == "127.0.0.1" for address, _ in listening), listening
