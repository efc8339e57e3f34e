"""The engine over a real Redis L3: hits across flushes, a server that dies and comes back,
and an LRU server too small for what the engine stores (a module of its own: it kills
its server).

Whatever L3 does, every request succeeds and its greedy tokens are the ones a
cold run gives: from Redis while the server is up and holds the pages,
recomputed while it is down or after it evicted them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from hicache.engine.engine import Engine
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.testing.redis_server import RedisServerProcess, start_redis_server
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.integration.engine.test_engine_soak import soak, soak_engine_flags
from tests.l3_engine_checks import (
    FAST_BREAKER,
    assert_hit_after_flush,
    assert_recomputed_while_down,
    assert_stored_and_hit_again,
    l3_engine_flags,
)
from tests.redis_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    fresh_prefix,
    server_fixture,
)

# A client that waited on the dead server would wait out these timeouts, far past the
# bound on a request while it is down (l3_engine_checks.DOWN_S).
PATIENT_CLIENT = {"connect_timeout_s": 60.0, "socket_timeout_s": 60.0}


def test_engine_outputs_stay_identical_while_the_server_dies_and_returns(
    make_engine: Callable[..., Engine], redis_server: RedisServerProcess,
    redis_extra: dict[str, Any],
) -> None:
    engine = make_engine(
        *l3_engine_flags("redis", {**redis_extra, **PATIENT_CLIENT, **FAST_BREAKER})
    )
    assert engine.cache.storage is not None, engine.cache.storage_error
    assert isinstance(engine.cache.storage.backend, RedisBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from Redis

    redis_server.kill()
    assert_recomputed_while_down(engine, ids, cold.token_ids)

    redis_server.restart()  # an empty server: the next prompt is stored again, then hit
    assert_stored_and_hit_again(engine)
    engine.check_integrity()


@pytest.fixture
def lru_server() -> Iterator[RedisServerProcess]:
    """A 2 MB server (about 1 MB for pages; the soak backs up about 1.8 MB) that evicts
    the least recently used keys; killed after the test."""
    with start_redis_server(
        extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    ) as server:
        yield server


def test_conversations_answer_as_cold_over_an_lru_server_that_evicts(
    make_engine: Callable[..., Engine], lru_server: RedisServerProcess,
) -> None:
    """The engine soak (tests/integration/engine/test_engine_soak.py) over a Redis that cannot
    hold what the engine backs up: evicted pages are misses and recomputed."""
    extra = {"url": lru_server.url, "prefix": fresh_prefix()}
    flags = soak_engine_flags("redis", extra, "write_through", "page_first", "wait_complete")
    soak(make_engine, flags, expect_storage_hits=True)
    info = redis.Redis.from_url(lru_server.url).info("stats")
    assert info["evicted_keys"] > 0, "the server never evicted: raise the soak or lower maxmemory"
