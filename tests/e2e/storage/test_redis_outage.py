"""A redis-server killed mid-run and started again on the same port (a module of its own:
it kills its server).

While the server is down every call is a miss that returns at once (loopback
refuses connections), nothing raises, the storage controller's breaker opens and
requests go on, recomputing. Once a new server listens on the same port, L3 is
used again without restarting or re-attaching anything.
"""

from __future__ import annotations

import time
from typing import Any

from hicache.storage.backends.redis.backend import RedisBackend
from hicache.testing.redis_server import RedisServerProcess
from tests.e2e.storage.test_redis_backend import open_pair
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.l3_outage_checks import (
    FAST_S,
    OUTAGE_STORAGE,
    assert_another_cache_finds,
    serve_until_backed_up_again,
    serve_while_the_store_is_down,
)
from tests.redis_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    make_cache,
    server_fixture,
)
from tests.storage_contract import (
    as_bytes,
    fill_random,
    page_bytes_of,
    page_range,
)

# A call (backend) or request (cache) while the server is down is bounded by FAST_S; a
# client that waited on the dead server would wait out these timeouts, far past it.
PATIENT_CLIENT = {"connect_timeout_s": 60.0, "socket_timeout_s": 60.0}


def test_calls_while_the_server_is_gone_are_fast_misses_and_work_again_after_restart(
    redis_server: RedisServerProcess, redis_extra: dict[str, Any]
) -> None:
    backend, host, keys = open_pair({**redis_extra, **PATIENT_CLIENT})
    try:
        values = fill_random(host, page_range(0, 6), seed=1)
        assert backend.set(keys[:3], page_range(0, 3)) == 3

        redis_server.kill()
        calls = [
            lambda: backend.exists(keys),
            lambda: backend.get(keys, page_range(10, 16)),
            lambda: backend.set(keys, page_range(0, 6)),
            lambda: backend.clear(),
        ]
        for call in calls:
            began = time.monotonic()
            assert not call()  # 0 pages (clear: None), never an exception
            assert time.monotonic() - began < FAST_S
        failures = backend.stats().failures
        assert set(failures) == {"unreachable"} and failures["unreachable"] >= 6 + 6 + 6 + 1

        redis_server.restart()  # the same port; an empty server (nothing is saved)
        assert backend.exists(keys) == 0  # the pool's dead connections were replaced
        assert backend.set(keys, page_range(0, 6)) == 6
        assert backend.get(keys, page_range(10, 16)) == 6
        assert page_bytes_of(host, page_range(10, 16)) == as_bytes(values)
    finally:
        backend.close()


def test_a_dead_server_opens_the_breaker_and_l3_returns_after_restart(
    redis_server: RedisServerProcess, redis_extra: dict[str, Any]
) -> None:
    if not redis_server.running:
        redis_server.restart()
    cache = make_cache(
        {**redis_extra, **PATIENT_CLIENT}, breaker_failures=2, breaker_backoff_base=0.2,
        breaker_backoff_max=0.2, **OUTAGE_STORAGE,
    )
    try:
        assert cache.storage is not None, cache.storage_error
        backend = cache.storage.backend
        assert isinstance(backend, RedisBackend)
        serve_with_l3(cache, conversation(40, seed=1))
        settle(cache)
        assert cache.stats.num_storage_backed_up_pages == 10

        redis_server.kill()
        serve_while_the_store_is_down(cache)

        redis_server.restart()  # empty: serve until a conversation is backed up there
        seed = serve_until_backed_up_again(cache)
        assert cache.stats.num_storage_backed_up_pages == 20
        # Another cache finds that conversation on the new server.
        assert_another_cache_finds(make_cache(redis_extra), seed)
    finally:
        cache.close()


def test_a_cache_attaches_and_detaches_the_backend_by_name(
    redis_server: RedisServerProcess, redis_extra: dict[str, Any]
) -> None:
    """The admin API's path: attach_storage(StorageConfig(backend="redis", ...)), detach."""
    if not redis_server.running:
        redis_server.restart()
    cache = make_cache(redis_extra)
    try:
        assert cache.storage is not None and cache.storage.backend.name == "redis"
        config = cache.storage.config
        serve_with_l3(cache, conversation(24, seed=7))
        settle(cache)
        cache.detach_storage()
        assert cache.storage is None
        cache.flush()
        cache.attach_storage(config)
        assert isinstance(cache.storage.backend, RedisBackend)
        assert serve_with_l3(cache, conversation(24, seed=7)) == 24
        settle(cache)
    finally:
        cache.close()

