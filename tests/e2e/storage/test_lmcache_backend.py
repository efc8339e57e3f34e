"""The lmcache backend against a real lmcache_server: settings, damaged and torn values,
a frozen or dead server, clears seen by other instances, namespaces and many threads.

Values are damaged by writing to the server directly with our raw client
(``lmcache_client``), as another writer (or a bug) would.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.net import free_port
from hicache.storage.backends.lmcache.backend import LMCacheBackend
from hicache.storage.backends.lmcache.client import Client, Connection
from hicache.storage.backends.lmcache.protocol import (
    Command,
    ProtocolError,
    encode_request,
    key_string,
)
from hicache.storage.base import StorageError, StorageUnavailableError
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.registry import create_storage_backend, unavailable_reason
from hicache.testing.lmcache_server import LMCacheServerProcess, start_server
from tests.lmcache_fixtures import GEOMETRY, PROGRAM, extra_fixture, server_fixture  # noqa: F401
from tests.storage_contract import page_bytes_of, page_range
from tests.waiting import wait_until

PAGE_SIZE = 4
# "At once" for a call to a dead or frozen server: far under what a client that waited on
# the server would wait (PATIENT_CLIENT's timeouts, a minute; a frozen server answers only
# once the test resumes it), generous for a machine busy with other work.
AT_ONCE_S = 20.0
PATIENT_CLIENT = {"timeout_s": 60.0, "connect_timeout_s": 60.0}
# A socket timeout for calls that must succeed beside ones that must time out quickly.
PATIENT_TIMEOUT_S = 5.0


def host_pool(layout: MemLayout = MemLayout.PAGE_FIRST) -> HostPool:
    return HostPool(GEOMETRY, 64, PAGE_SIZE, layout, pin_memory=False)


def fill(host: HostPool, pages: np.ndarray, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    host.pages[torch.from_numpy(pages)] = torch.randn(
        host.pages[torch.from_numpy(pages)].shape, generator=generator
    )


def new_keys(count: int) -> list[bytes]:
    return [uuid.uuid4().bytes for _ in range(count)]


def raw_client(url: str) -> Client:
    host, port = url.removeprefix("lm://").rsplit(":", 1)
    return Client(
        host, int(port), timeout_s=5, connect_timeout_s=2, retry_interval_s=0, max_idle=1
    )


def raw_get(url: str, key: str) -> bytes | None:
    client = raw_client(url)
    try:
        with client.connection() as conn:
            conn.send([encode_request(Command.GET, key)])
            reply = conn.read_reply()
            if not reply.ok:
                return None
            value = bytearray(reply.value_bytes)
            conn.read_into([value])
            return bytes(value)
    finally:
        client.close()


def stored_value(url: str, key: str) -> bytes | str | None:
    """``raw_get``, or the name of the error a read of a torn value ends with."""
    try:
        return raw_get(url, key)
    except (OSError, ProtocolError) as error:
        return type(error).__name__


def raw_put(url: str, key: str, value: bytes) -> None:
    client = raw_client(url)
    try:
        with client.connection() as conn:
            conn.put([(key, [value])], key)
    finally:
        client.close()


# ------------------------------------------------------------------ settings
@pytest.fixture(autouse=True)
def _no_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_REMOTE_URL", raising=False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "remote_url is required"),
        ({"remote_url": "redis://127.0.0.1:6379"}, "lm://host:port"),
        ({"remote_url": "lm://127.0.0.1"}, "host:port"),
        ({"remote_url": "127.0.0.1:70000"}, "host:port"),
        ({"remote_url": "127.0.0.1:1", "namespace": "a@b"}, "namespace"),
        ({"remote_url": "127.0.0.1:1", "connections": 0}, "connections"),
        ({"remote_url": "127.0.0.1:1", "connections": 1.5}, "whole number"),
        ({"remote_url": "127.0.0.1:1", "timeout_s": 0}, "timeout_s"),
        ({"remote_url": "127.0.0.1:1", "timeout": 3}, "unknown extra-config key"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        LMCacheBackend(extra)


def test_the_url_comes_from_lmcaches_variable_unless_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "lm://10.1.2.3:6000")
    settings = LMCacheBackend({}).settings
    assert (settings.host, settings.port, settings.namespace) == ("10.1.2.3", 6000, "hicache")
    settings = LMCacheBackend({"remote_url": "127.0.0.1:7000"}).settings
    assert (settings.host, settings.port) == ("127.0.0.1", 7000)


def test_the_registry_builds_it_by_name_without_lmcache_installed(
    lmcache_extra: dict[str, Any],
) -> None:
    assert unavailable_reason("lmcache") is None
    backend = create_storage_backend("lmcache", lmcache_extra)
    assert isinstance(backend, LMCacheBackend)
    backend.close()
    # Our client speaks the wire protocol itself: LMCache is not in this environment.
    with pytest.raises(ImportError):
        __import__("lmcache")


def test_an_unreachable_server_fails_attach_at_once() -> None:
    backend = LMCacheBackend({"remote_url": f"127.0.0.1:{free_port()}", **PATIENT_CLIENT})
    began = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="cannot reach lmcache_server"):
        backend.attach(host_pool())
    assert time.monotonic() - began < AT_ONCE_S
    backend.close()


# ------------------------------------------------------------------ damaged values
@pytest.fixture
def stored(lmcache_extra: dict[str, Any]) -> Iterator[tuple[LMCacheBackend, HostPool, list]]:
    """A backend with 4 pages stored (host pages 0-3) under fresh keys."""
    host = host_pool()
    backend = LMCacheBackend(lmcache_extra)
    backend.attach(host)
    keys = new_keys(4)
    fill(host, page_range(0, 4), seed=1)
    assert backend.set(keys, page_range(0, 4)) == 4
    yield backend, host, keys
    backend.close()


def flip_payload_bit(value: bytes) -> bytes:
    damaged = bytearray(value)
    damaged[5] ^= 0x10
    return bytes(damaged)


@pytest.mark.parametrize(
    ("damage", "fault"),
    [
        (flip_payload_bit, "corrupt"),
        (lambda value: value[: len(value) // 2], "short_read"),
        (lambda value: value + b"extra", "wrong_length"),
        (lambda value: b"\0" * len(value), "bad_magic"),
    ],
)
def test_a_damaged_value_is_a_miss_remembered_until_rewritten(
    stored: tuple[LMCacheBackend, HostPool, list], lmcache_server: LMCacheServerProcess,
    damage: Any, fault: str,
) -> None:
    backend, host, keys = stored
    name = backend.server_keys(keys[2:3])[0]
    original = raw_get(lmcache_server.url, name)
    assert original is not None and len(original) == host.page_bytes + HEADER_BYTES
    raw_put(lmcache_server.url, name, damage(original))

    assert backend.get(keys, page_range(10, 14)) == 2
    assert backend.stats().failures == {fault: 1}
    assert page_bytes_of(host, page_range(10, 12)) == page_bytes_of(host, page_range(0, 2))
    # The server cannot delete it; this instance stops lookups there and rewrites it.
    assert backend.exists(keys) == 2
    written = backend.stats().pages_written
    assert backend.set(keys, page_range(0, 4)) == 4
    assert backend.stats().pages_written == written + 1
    assert raw_get(lmcache_server.url, name) == original
    assert backend.get(keys, page_range(20, 24)) == 4
    assert page_bytes_of(host, page_range(20, 24)) == page_bytes_of(host, page_range(0, 4))


def test_another_pages_value_under_this_name_is_a_wrong_key_even_unverified(
    lmcache_extra: dict[str, Any], lmcache_server: LMCacheServerProcess,
) -> None:
    host = host_pool()
    backend = LMCacheBackend({**lmcache_extra, "verify_checksum": False})
    backend.attach(host)
    try:
        keys = new_keys(3)
        fill(host, page_range(0, 3), seed=2)
        assert backend.set(keys, page_range(0, 3)) == 3
        first, second = backend.server_keys(keys[:2])
        value = raw_get(lmcache_server.url, first)
        assert value is not None
        raw_put(lmcache_server.url, second, value)
        assert backend.get(keys, page_range(10, 13)) == 1
        assert backend.stats().failures == {"wrong_key": 1}
        # Without checksums a flipped payload bit goes unnoticed (the header is intact).
        raw_put(lmcache_server.url, first, flip_payload_bit(value))
        assert backend.get(keys[:1], page_range(10, 11)) == 1
    finally:
        backend.close()


def test_a_put_cut_off_midway_is_a_short_read_not_an_error(
    stored: tuple[LMCacheBackend, HostPool, list], lmcache_server: LMCacheServerProcess,
) -> None:
    """A writer that dies mid-value leaves the server an empty value that drops its reader."""
    backend, host, keys = stored
    name = backend.server_keys(keys[1:2])[0]
    size = host.page_bytes + HEADER_BYTES
    with socket.create_connection((lmcache_server.host, lmcache_server.port), timeout=5) as sock:
        sock.sendall(encode_request(Command.PUT, name, size) + b"\1" * (size // 2))
    # The server's thread for that connection stores what it got in place of the whole value:
    # once it did, a read of it is dropped.
    assert wait_until(lambda: isinstance(stored_value(lmcache_server.url, name), str))

    assert backend.get(keys, page_range(10, 14)) == 1
    assert backend.stats().failures == {"short_read": 1}
    assert backend.exists(keys) == 1
    assert backend.set(keys, page_range(0, 4)) == 4  # rewritten over the torn value
    assert backend.get(keys, page_range(10, 14)) == 4
    assert page_bytes_of(host, page_range(10, 14)) == page_bytes_of(host, page_range(0, 4))


# ------------------------------------------------------------------ server down or frozen
@pytest.fixture
def own_server() -> Iterator[LMCacheServerProcess]:
    """A server of this test alone (it is killed or frozen)."""
    with start_server(program=PROGRAM) as server:
        try:
            yield server
        finally:
            if server.pid is not None:  # never leave it stopped
                os.kill(server.pid, signal.SIGCONT)


def test_a_dead_server_gives_fast_misses_and_the_backend_recovers_on_restart(
    own_server: LMCacheServerProcess,
) -> None:
    host = host_pool()
    backend = LMCacheBackend(
        {"remote_url": own_server.url, "retry_interval_s": 0.2, **PATIENT_CLIENT}
    )
    backend.attach(host)
    try:
        keys = new_keys(4)
        fill(host, page_range(0, 4), seed=3)
        assert backend.set(keys, page_range(0, 4)) == 4
        own_server.kill()
        began = time.monotonic()
        assert backend.exists(keys) == 0
        assert backend.get(keys, page_range(10, 14)) == 0
        assert backend.set(keys, page_range(0, 4)) == 0
        backend.clear()  # counted, not raised
        assert time.monotonic() - began < AT_ONCE_S
        assert not backend.reachable
        assert backend.stats().failures.get("unreachable", 0) >= 3

        own_server.restart()  # an empty store on the same port
        time.sleep(0.25)  # past retry_interval_s
        assert backend.reachable
        assert backend.exists(keys) == 0
        assert backend.set(keys, page_range(0, 4)) == 4
        assert backend.get(keys, page_range(10, 14)) == 4
        assert page_bytes_of(host, page_range(10, 14)) == page_bytes_of(host, page_range(0, 4))
    finally:
        backend.close()


def test_a_server_killed_under_a_connected_client_restarts_on_its_port(
    own_server: LMCacheServerProcess,
) -> None:
    # The killed server's side of the open connection sits in TIME_WAIT on the
    # server's port; LMCache binds without SO_REUSEADDR, so only our launcher
    # lets the restart bind that port again (it failed with errno 98 before).
    with socket.create_connection((own_server.host, own_server.port), timeout=60) as client:
        # A request answered on it: the server accepted the connection and holds its end.
        probe = Connection(client)
        probe.send([encode_request(Command.HEALTH, key_string("accepted", b"\x01"))])
        assert probe.read_reply().ok
        own_server.kill()
        client.settimeout(60)
        assert client.recv(1) == b""  # the server's end closed first
    own_server.restart()
    assert own_server.running
    assert raw_get(own_server.url, key_string("restart", b"\x01")) is None  # and it serves


def wait_stopped(pid: int) -> None:
    """Until the process is stopped (a signal is delivered asynchronously)."""
    stat = Path(f"/proc/{pid}/stat")
    assert wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "T", 60), (
        "the server did not stop"
    )


def use_timeout(backend: LMCacheBackend, timeout_s: float) -> None:
    """Give the connections ``backend`` opens from now on this timeout (the setting is read
    once, at attach, and each connection keeps the timeout it was opened with): the idle
    ones are closed so that the next call connects afresh."""
    client = backend._client
    assert client is not None
    client.timeout_s = timeout_s
    client._drop_idle()


def test_a_frozen_server_times_out_and_is_used_again_once_it_answers(
    own_server: LMCacheServerProcess,
) -> None:
    host = host_pool()
    # The calls that must succeed wait patiently (a busy machine may be slow to answer,
    # more so a server just resumed); only those to the frozen server have the short one.
    backend = LMCacheBackend({"remote_url": own_server.url, "timeout_s": PATIENT_TIMEOUT_S})
    backend.attach(host)
    try:
        keys = new_keys(2)
        fill(host, page_range(0, 2), seed=4)
        assert backend.set(keys, page_range(0, 2)) == 2
        assert own_server.pid is not None
        os.kill(own_server.pid, signal.SIGSTOP)
        wait_stopped(own_server.pid)
        use_timeout(backend, 0.3)
        began = time.monotonic()
        assert backend.get(keys, page_range(10, 12)) == 0
        # Its 0.3 s timeout: not the frozen server (which answers only once the test resumes
        # it) nor the default timeout (5 s); the rest is room for a busy machine.
        assert 0.25 < time.monotonic() - began < 0.3 + 3.0
        assert backend.stats().failures == {"timeout": 1}
        # A backup while it is frozen times out and reports nothing stored.
        unconfirmed = new_keys(2)
        assert backend.set(unconfirmed, page_range(0, 2)) == 0
        assert backend.stats().failures == {"timeout": 2}
        use_timeout(backend, PATIENT_TIMEOUT_S)
        os.kill(own_server.pid, signal.SIGCONT)
        assert backend.get(keys, page_range(10, 12)) == 2  # on a new connection
        assert backend.exists(unconfirmed) == 0
        written = backend.stats().pages_written
        assert backend.set(unconfirmed, page_range(0, 2)) == 2
        assert backend.stats().pages_written == written + 2
        assert backend.exists(unconfirmed) == 2
    finally:
        backend.close()


def test_a_backup_whose_confirmation_is_lost_is_rewritten_not_trusted(
    stored: tuple[LMCacheBackend, HostPool, list], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PUTs whose barrier reply never came may have been cut off mid-value: not trusted."""
    backend, host, _ = stored
    keys = new_keys(2)
    fill(host, page_range(4, 6), seed=9)
    original_put = Connection.put

    def put_then_lose_the_reply(self: Connection, *args: Any) -> None:
        original_put(self, *args)
        raise TimeoutError("the barrier reply was lost")

    monkeypatch.setattr(Connection, "put", put_then_lose_the_reply)
    assert backend.set(keys, page_range(4, 6)) == 0
    assert backend.stats().failures == {"timeout": 1}
    monkeypatch.setattr(Connection, "put", original_put)
    assert backend.exists(keys) == 0  # stored on the server, but not trusted
    written = backend.stats().pages_written
    assert backend.set(keys, page_range(4, 6)) == 2
    assert backend.stats().pages_written == written + 2
    assert backend.exists(keys) == 2
    assert backend.get(keys, page_range(10, 12)) == 2
    assert page_bytes_of(host, page_range(10, 12)) == page_bytes_of(host, page_range(4, 6))


# ------------------------------------------------------------------ sharing one server
def test_a_clear_is_seen_by_an_instance_attached_before_it(lmcache_extra: dict[str, Any]) -> None:
    first_host, second_host = host_pool(), host_pool()
    first, second = LMCacheBackend(lmcache_extra), LMCacheBackend(lmcache_extra)
    first.attach(first_host)
    second.attach(second_host)
    try:
        keys = new_keys(3)
        fill(first_host, page_range(0, 3), seed=5)
        assert first.set(keys, page_range(0, 3)) == 3
        assert second.exists(keys) == 3
        first.clear()
        assert second.exists(keys) == 0  # it reads the new generation with the lookup
        assert second.set(keys, page_range(0, 3)) == 3
        assert first.exists(keys) == 3
    finally:
        first.close()
        second.close()


def test_namespaces_on_one_server_do_not_share(lmcache_extra: dict[str, Any]) -> None:
    host = host_pool()
    ours = LMCacheBackend({**lmcache_extra, "namespace": "tenant-a"})
    theirs = LMCacheBackend({**lmcache_extra, "namespace": "tenant-b"})
    ours.attach(host)
    theirs.attach(host)
    try:
        keys = new_keys(2)
        fill(host, page_range(0, 2), seed=6)
        assert ours.set(keys, page_range(0, 2)) == 2
        assert theirs.exists(keys) == 0
        ours.clear()  # a clear of one namespace leaves the other alone
        assert theirs.set(keys, page_range(0, 2)) == 2
        assert theirs.exists(keys) == 2
    finally:
        ours.close()
        theirs.close()


def test_many_threads_share_a_few_connections(lmcache_extra: dict[str, Any]) -> None:
    host = HostPool(GEOMETRY, 8 * 16 * 2, PAGE_SIZE, MemLayout.LAYER_FIRST, pin_memory=False)
    backend = LMCacheBackend({**lmcache_extra, "connections": 2})
    backend.attach(host)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            source = page_range(32 * index, 32 * index + 16)
            target = page_range(32 * index + 16, 32 * index + 32)
            fill(host, source, seed=100 + index)
            for round_ in range(5):
                keys = new_keys(16)
                assert backend.set(keys, source) == 16
                assert backend.exists(keys) == 16
                assert backend.get(keys, target) == 16, round_
                assert page_bytes_of(host, target) == page_bytes_of(host, source)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors
        assert backend.stats().failures == {}
    finally:
        backend.close()
