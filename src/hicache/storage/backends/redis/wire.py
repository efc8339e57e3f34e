"""Pipelined SETs whose values are sent straight from the memory they live in.

redis-py takes every value as one buffer, so a page stored as ``payload ||
header`` through its ``pipeline().set`` has to be joined into a new bytes
object first: a copy of every page, into freshly allocated memory whose page
faults cost more than the copy (on the development machine, joining 32 pages
of 8 MiB took ~290 ms, the same copy into a reused buffer ~40 ms). Here a SET
is framed by hand in the Redis protocol (RESP) around the value's fragments,
the page's regions in the host pool and its header, and sent with the
connection's ``send_packed_command``, which writes each fragment to the
socket as it is: no copy on our side at all.

Everything else is redis-py's: the connection pool (so url, TLS, unix
sockets, authentication and timeouts are as configured), reading and parsing
the replies, and its exception types.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

# Anything the socket can send: bytes, or a memoryview of a page region.
Fragment = bytes | memoryview


def set_command(
    name: bytes, fragments: Sequence[Fragment], nx: bool = False, px_ms: int | None = None
) -> list[Fragment]:
    """``SET name <fragments joined> [NX] [PX px_ms]`` as RESP pieces ready to send.

    The value is never joined: its fragments are sent one after another as the
    body of a single bulk string, whose length announces their total.
    """
    value_bytes = sum(memoryview(f).nbytes for f in fragments)
    options: list[bytes] = []
    if nx:
        options.append(b"NX")
    if px_ms is not None:
        options += [b"PX", str(px_ms).encode()]
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        3 + len(options), len(name), name, value_bytes,
    )
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(option), option) for option in options)
    last = fragments[-1] if fragments else b""
    if memoryview(last).nbytes <= 4096:  # a small last fragment (the header): sent with the tail
        return [head, *fragments[:-1], bytes(last) + tail]
    return [head, *fragments, tail]


def pipelined(
    pool: redis.ConnectionPool, commands: Sequence[Sequence[Fragment]], retries: int = 1
) -> list[object]:
    """Send ``commands`` on one connection of ``pool``, then read one reply per command.

    Returns the replies in order; an error reply (e.g. OOM from a full server)
    is returned as its ``redis.ResponseError`` in its place, the others still
    read. A connection that fails or times out is dropped and the whole batch
    is sent again on a new one, at most ``retries`` times (SET is idempotent);
    after that ``redis.ConnectionError`` / ``redis.TimeoutError`` propagate.
    """
    pieces = [piece for command in commands for piece in command]
    for attempt in range(retries + 1):
        connection = None
        try:
            connection = pool.get_connection()
            connection.send_packed_command(pieces, check_health=False)
            replies: list[object] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except redis.ResponseError as error:  # the connection stays in step
                    replies.append(error)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            if connection is not None:
                connection.disconnect()  # half-sent or half-read: never reuse it
            if attempt == retries:
                raise
        finally:
            if connection is not None:
                pool.release(connection)
    raise AssertionError("unreachable")
