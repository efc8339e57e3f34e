"""Hand-framed pipelined SETs (``storage.backends.redis.wire``) against a real redis-server."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from hicache.net import free_port
from hicache.storage.backends.redis.wire import pipelined, set_command
from hicache.testing.redis_server import RedisServerProcess
from tests.redis_fixtures import server_fixture  # noqa: F401 - a fixture, used by name


@pytest.fixture
def client(redis_server: RedisServerProcess) -> redis.Redis:
    connection = redis.Redis.from_url(redis_server.url)
    connection.flushdb()  # this module's own server
    return connection


def test_the_fragments_are_stored_as_one_value(client: redis.Redis) -> None:
    pool_bytes = np.random.default_rng(0).integers(0, 256, 3 * 8192, dtype=np.uint8)
    regions = [memoryview(pool_bytes)[i * 8192 : (i + 1) * 8192] for i in range(3)]
    small_last = [*regions, b"header-bytes"]
    large_last = [b"head", *regions]  # a big last fragment is sent on its own
    commands = [
        set_command(b"k:small", small_last), set_command(b"k:large", large_last),
        set_command(b"k:empty", [b""]),
    ]
    assert pipelined(client.connection_pool, commands) == [b"OK", b"OK", b"OK"]
    assert client.get(b"k:small") == pool_bytes.tobytes() + b"header-bytes"
    assert client.get(b"k:large") == b"head" + pool_bytes.tobytes()
    assert client.get(b"k:empty") == b""


def test_nx_keeps_the_stored_value_and_px_sets_an_expiry(client: redis.Redis) -> None:
    client.set(b"k:old", b"first")
    replies = pipelined(client.connection_pool, [
        set_command(b"k:old", [b"second"], nx=True),
        set_command(b"k:new", [b"value"], nx=True, px_ms=5000),
    ])
    assert replies == [None, b"OK"]  # NX refused the existing key
    assert client.get(b"k:old") == b"first"
    assert 0 < client.pttl(b"k:new") <= 5000
    assert client.pttl(b"k:old") == -1


def test_an_error_reply_takes_its_place_and_the_rest_are_read(client: redis.Redis) -> None:
    client.config_set("maxmemory", "1")  # noeviction: every write is refused with OOM
    try:
        replies = pipelined(
            client.connection_pool, [set_command(b"k:a", [b"x"]), set_command(b"k:b", [b"y"])]
        )
    finally:
        client.config_set("maxmemory", "0")
    assert len(replies) == 2
    assert all(isinstance(reply, redis.exceptions.OutOfMemoryError) for reply in replies)
    # The connection went back to the pool in step: the next command reads its own reply.
    assert pipelined(client.connection_pool, [set_command(b"k:a", [b"x"])]) == [b"OK"]
    assert client.get(b"k:a") == b"x"


def test_a_server_that_is_not_there_raises_a_connection_error() -> None:
    pool = redis.ConnectionPool.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(redis.ConnectionError):
        pipelined(pool, [set_command(b"k", [b"v"])])
    pool.disconnect()
