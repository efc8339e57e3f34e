"""The lmcache backend when the server drops a pipelined batch before flushing its replies.

LMCache's server closes a connection as soon as it meets a torn value (a PUT
cut off mid-value). Replies to earlier GETs of the batch that it had not yet
flushed are lost with the connection, so the drop does not say which page is
torn. A small in-process server here models that deterministically: it
flushes its replies only once it has served every request it has read, and a
torn value discards what is unflushed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.lmcache.backend import LMCacheBackend
from hicache.storage.backends.lmcache.protocol import (
    REPLY,
    REQUEST,
    REQUEST_BYTES,
    Command,
    ReplyCode,
)
from tests.storage_contract import page_bytes_of, page_range

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


class LateFlushingServer:
    """Serves PUT, GET, EXIST and HEALTH from a dict; a key in ``torn`` is read as a value
    cut off midway: its reply header and half its bytes, then the connection closes,
    taking unflushed replies with it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.torn: set[str] = set()
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def close(self) -> None:
        # A shutdown wakes the accepting thread (closing alone leaves it blocked).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join(timeout=10)
        for thread in self._threads:
            thread.join(timeout=10)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        pending = bytearray()  # read, not yet served
        out = bytearray()  # replies not yet flushed
        with sock:
            while True:
                while len(pending) >= REQUEST_BYTES:
                    command, size, *_, raw_key = REQUEST.unpack_from(pending)
                    key = raw_key.decode("ascii").rstrip()
                    if command == Command.PUT:
                        if len(pending) < REQUEST_BYTES + size:
                            break
                        self.values[key] = bytes(pending[REQUEST_BYTES : REQUEST_BYTES + size])
                        del pending[: REQUEST_BYTES + size]
                        continue
                    del pending[:REQUEST_BYTES]
                    value = self.values.get(key) if command == Command.GET else None
                    if command == Command.GET and key in self.torn and value is not None:
                        # What is unflushed is lost: the client sees only what went before.
                        sock.sendall(_reply(ReplyCode.SUCCESS, len(value)))
                        sock.sendall(value[: len(value) // 2])
                        return
                    if value is not None:
                        out += _reply(ReplyCode.SUCCESS, len(value)) + value
                    elif command == Command.EXIST:
                        found = key in self.values
                        out += _reply(ReplyCode.SUCCESS if found else ReplyCode.FAIL, 0)
                    else:
                        ok = command == Command.HEALTH
                        out += _reply(ReplyCode.SUCCESS if ok else ReplyCode.FAIL, 0)
                sock.sendall(out)
                out.clear()
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                pending += data


def _reply(code: ReplyCode, value_bytes: int) -> bytes:
    return REPLY.pack(int(code), value_bytes, 0, 0, 0, 0, 0, 0, 0)


@pytest.fixture
def server() -> Iterator[LateFlushingServer]:
    server = LateFlushingServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def stored(server: LateFlushingServer) -> Iterator[tuple[LMCacheBackend, HostPool, list[bytes]]]:
    host = HostPool(GEOMETRY, 64, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = LMCacheBackend({"remote_url": f"127.0.0.1:{server.port}"})
    backend.attach(host)
    generator = torch.Generator().manual_seed(5)
    host.pages[:4] = torch.randn(host.pages[:4].shape, generator=generator)
    keys = [bytes([i]) * 16 for i in range(4)]
    assert backend.set(keys, page_range(0, 4)) == 4
    with contextlib.closing(backend):
        yield backend, host, keys


@pytest.mark.parametrize("torn_page", [0, 1, 3])
def test_the_torn_page_is_found_though_the_batch_lost_every_reply(
    server: LateFlushingServer,
    stored: tuple[LMCacheBackend, HostPool, list[bytes]],
    torn_page: int,
) -> None:
    backend, host, keys = stored
    server.torn.add(backend.server_keys(keys)[torn_page])
    connections = server.connections

    assert backend.get(keys, page_range(10, 14)) == torn_page
    # The pages before it were read one by one on a second connection, and only the torn
    # page is remembered as bad: no "unreachable" is counted for a server that is up.
    assert server.connections == connections + 1
    assert backend.stats().failures == {"short_read": 1}
    assert page_bytes_of(host, page_range(10, 10 + torn_page)) == page_bytes_of(
        host, page_range(0, torn_page)
    )
    assert backend.exists(keys) == torn_page
    server.torn.clear()
    assert backend.set(keys, page_range(0, 4)) == 4  # the torn one is rewritten
    assert backend.get(keys, page_range(20, 24)) == 4
    assert page_bytes_of(host, page_range(20, 24)) == page_bytes_of(host, page_range(0, 4))


def test_a_batch_without_a_torn_page_is_one_exchange(
    server: LateFlushingServer, stored: tuple[LMCacheBackend, HostPool, list[bytes]],
) -> None:
    backend, host, keys = stored
    connections = server.connections
    assert backend.get(keys, page_range(10, 14)) == 4
    assert server.connections == connections
    assert backend.stats().failures == {}
    assert page_bytes_of(host, page_range(10, 14)) == page_bytes_of(host, page_range(0, 4))
