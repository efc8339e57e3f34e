"""The engine over a real Redis L3: hits across flushes, a server that dies and comes back,
and an LRU server too small for what the engine stores (a module of its own: it kills
its server).

Whatever L3 does, every request succeeds and its greedy tokens are the ones a
cold run gives: from Redis while the server is up and holds the pages,
recomputed while it is down or after it evicted them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from hicache.engine.engine import Engine
from hicache.storage.redis import RedisBackend
from hicache.storage.redis_server import RedisServerProcess, start_redis_server
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.redis_fixtures import (  # noqa: F401 - fixtures, used by name
    extra_fixture,
    fresh_prefix,
    server_fixture,
)
from tests.unit.engine.test_engine_cache_reuse import PAGE, PROMPT_LEN, prompt
from tests.unit.engine.test_engine_soak import soak, soak_engine_flags

REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
RECOVERY_S = 10.0


def redis_flags(extra: dict[str, Any]) -> tuple[str, ...]:
    config = {
        **extra, "prefetch_threshold": 64,
        "breaker_failures": 2, "breaker_backoff_base": 0.2, "breaker_backoff_max": 0.2,
    }
    return (
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "redis",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )


def test_engine_outputs_stay_identical_while_the_server_dies_and_returns(
    make_engine: Callable[..., Engine], redis_server: RedisServerProcess,
    redis_extra: dict[str, Any],
) -> None:
    engine = make_engine(*redis_flags(redis_extra))
    assert engine.cache.storage is not None, engine.cache.storage_error
    assert isinstance(engine.cache.storage.backend, RedisBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()  # L1 and L2 forget it; Redis keeps it
    warm = run(engine, ids, ignore_eos=True)
    assert warm.last.cached_tokens.storage == REUSED
    assert warm.token_ids == cold.token_ids

    redis_server.kill()
    for _ in range(3):  # each flush sends the request to L3, which cannot answer
        assert engine.flush_cache()
        began = time.monotonic()
        down = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < 2.0  # recomputed, not waiting on the dead server
        assert down.last.finish_reason == "length"
        assert down.last.cached_tokens.total == 0
        assert down.token_ids == cold.token_ids

    redis_server.restart()  # an empty server: the next prompt is stored again, then hit
    other = prompt(12)
    other_cold = run(engine, other, ignore_eos=True)
    deadline = time.monotonic() + RECOVERY_S
    while True:
        assert engine.flush_cache()
        back = run(engine, other, ignore_eos=True)
        assert back.token_ids == other_cold.token_ids
        if back.last.cached_tokens.storage == REUSED:
            break
        assert time.monotonic() < deadline, engine.storage_status()
        time.sleep(0.1)
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
    """The engine soak (tests/unit/engine/test_engine_soak.py) over a Redis that cannot
    hold what the engine backs up: evicted pages are misses and recomputed."""
    extra = {"url": lru_server.url, "prefix": fresh_prefix()}
    flags = soak_engine_flags("redis", extra, "write_through", "page_first", "wait_complete")
    soak(make_engine, flags, expect_storage_hits=True)
    info = redis.Redis.from_url(lru_server.url).info("stats")
    assert info["evicted_keys"] > 0, "the server never evicted: raise the soak or lower maxmemory"
