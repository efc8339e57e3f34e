"""Our own client of ``lmcache_server`` (``protocol``): pipelined requests, a pool of
connections, socket timeouts, and a short back-off after the server could not be reached.

The client never imports LMCache; it only speaks its wire format. A
``Connection`` sends many requests at once and then reads their replies in
order. ``Client.connection()`` lends one connection to one caller at a time
(the storage controller calls from several threads, each gets its own), opens
a new one when none is idle, and keeps up to ``max_idle`` for reuse.

Failures. Any socket error, timeout or unreadable reply breaks a connection:
it is closed, never reused (its stream may be out of step with its replies),
and the error propagates as an ``OSError`` or ``ProtocolError`` for the backend
to count. A connect that fails marks the server down for
``retry_interval_s``: meanwhile ``connection()`` raises ``ServerUnreachable``
at once instead of waiting for another connect timeout on every call.
"""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from hicache.storage.backends.lmcache.protocol import (
    REPLY_BYTES,
    Command,
    ProtocolError,
    Reply,
    decode_reply,
    encode_request,
)

# Buffers handed to one sendmsg call (the kernel's limit is IOV_MAX = 1024).
_MAX_IOV = 512
_DRAIN_CHUNK_BYTES = 1 << 20
_READ_BUFFER_BYTES = 256 << 10
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only

Buffer = bytes | bytearray | memoryview


class ServerUnreachable(ConnectionError):
    """No connection to the server could be made (now, or within the retry interval)."""


class Connection:
    """One TCP stream to the server; used by one thread at a time (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # Replies are small and many: a buffered reader saves a syscall per reply,
        # and reads larger than its buffer go straight into the caller's memory.
        self._reader = cast(io.BufferedReader, sock.makefile("rb", buffering=_READ_BUFFER_BYTES))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()

    # ------------------------------------------------------------ sending
    def send(self, buffers: Sequence[Buffer]) -> None:
        """Send the buffers back to back (requests, and the values that follow PUTs)."""
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        while pending:
            sent = self._sock.sendmsg(pending[:_MAX_IOV])
            while sent:
                if sent >= len(pending[0]):
                    sent -= len(pending[0])
                    pending.pop(0)
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0

    # ------------------------------------------------------------ receiving
    def read_reply(self) -> Reply:
        self._ack_quickly()
        header = bytearray(REPLY_BYTES)
        self.read_into([header])
        return decode_reply(header)

    def _ack_quickly(self) -> None:
        """Acknowledge what arrives at once instead of after the delayed-ACK timer.

        The server writes a reply's header and its value with two writes on a
        socket with Nagle's algorithm on: it holds a small value back until the
        header is acknowledged, and a client delaying its ACK (Linux: up to 40
        ms) stalls every small GET that long. Quick-ACK mode is not sticky, so
        it is set again before each reply.
        """
        if _QUICKACK is not None:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    def read_into(self, buffers: Sequence[Buffer]) -> None:
        """Fill ``buffers`` in order from the stream (a reply's value, split over them)."""
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while len(view):
                got = self._reader.readinto(view)
                if not got:
                    raise ConnectionResetError("lmcache_server closed the connection")
                view = view[got:]

    def discard(self, num_bytes: int) -> None:
        """Read and drop ``num_bytes`` (a value this client cannot use)."""
        scratch = bytearray(min(num_bytes, _DRAIN_CHUNK_BYTES))
        while num_bytes:
            part = memoryview(scratch)[: min(num_bytes, len(scratch))]
            self.read_into([part])
            num_bytes -= len(part)

    # ------------------------------------------------------------ whole exchanges
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored: one round trip for all of them."""
        self.send([encode_request(Command.EXIST, key) for key in keys])
        return [self.read_reply().ok for _ in keys]

    def put(self, items: Iterable[tuple[str, Sequence[Buffer]]], barrier_key: str) -> None:
        """Store each ``(key, value fragments)``; returns once the server stored them all.

        Each value is sent as soon as ``items`` yields it, so a caller that builds
        the next value (hashing a page) overlaps with the server receiving this
        one. PUTs have no reply: a HEALTH request after them is the barrier
        (answered only once every earlier request on this connection was served).
        """
        for key, fragments in items:
            size = sum(memoryview(f).nbytes for f in fragments)
            self.send([encode_request(Command.PUT, key, size), *fragments])
        self.send([encode_request(Command.HEALTH, barrier_key)])
        if not self.read_reply().ok:
            raise ProtocolError("lmcache_server answered a health check with a failure")

    def health(self, key: str) -> bool:
        self.send([encode_request(Command.HEALTH, key)])
        return self.read_reply().ok


class Client:
    """Connections to one ``lmcache_server``; thread-safe (see the module docstring)."""

    def __init__(
        self, host: str, port: int, *, timeout_s: float, connect_timeout_s: float,
        retry_interval_s: float, max_idle: int,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._down_until = 0.0
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def seems_down(self) -> bool:
        """True within the retry interval after a failed connect."""
        with self._lock:
            return time.monotonic() < self._down_until

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection for one exchange; a failed exchange closes it (see the module doc)."""
        conn = self._take()
        try:
            yield conn
        except BaseException as error:
            conn.close()
            if isinstance(error, ConnectionError):
                # The server closed or reset this connection: it probably restarted or
                # died, and the idle ones are as stale. Drop them so the next call
                # connects afresh instead of failing once more on an old stream.
                self._drop_idle()
            raise
        self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> Connection:
        with self._lock:
            if self._closed:
                raise ServerUnreachable("the lmcache client is closed")
            if self._idle:
                return self._idle.pop()
            if time.monotonic() < self._down_until:
                raise ServerUnreachable(f"lmcache_server at {self.address} is down (retrying)")
        try:
            sock = socket.create_connection(
                (self.host, self.port), timeout=self.connect_timeout_s
            )
        except OSError as error:
            with self._lock:
                self._down_until = time.monotonic() + self.retry_interval_s
            raise ServerUnreachable(
                f"cannot connect to lmcache_server at {self.address}: {error}"
            ) from error
        sock.settimeout(self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(sock)

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()
