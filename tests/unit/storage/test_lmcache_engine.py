"""The engine over a real lmcache_server as L3: greedy tokens equal a cold run's whether pages
come from LMCache, are recomputed while the server is down, or come back after it restarts;
and L3 attached and detached at run time by name (the admin endpoints' path).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from hicache.engine.engine import Engine
from hicache.storage.lmcache import LMCacheBackend
from hicache.storage.lmcache_server import ServerProcess
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.lmcache_fixtures import extra_fixture, server_fixture  # noqa: F401 - fixtures
from tests.unit.engine.test_engine_cache_reuse import PAGE, PROMPT_LEN, prompt

REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
RECOVERY_S = 20.0
ENGINE_FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "2048",
                "--enable-hierarchical-cache")


def lmcache_flags(extra: dict[str, Any]) -> tuple[str, ...]:
    config = {
        **extra, "prefetch_threshold": 64, "retry_interval_s": 0.1,
        "breaker_failures": 2, "breaker_backoff_base": 0.2, "breaker_backoff_max": 0.2,
    }
    return (
        *ENGINE_FLAGS, "--hicache-storage-backend", "lmcache",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )


def test_engine_outputs_equal_cold_while_the_server_dies_and_returns(
    make_engine: Callable[..., Engine], lmcache_server: ServerProcess,
    lmcache_extra: dict[str, Any],
) -> None:
    engine = make_engine(*lmcache_flags({**lmcache_extra, "namespace": "engine-outage"}))
    assert engine.cache.storage is not None, engine.cache.storage_error
    assert isinstance(engine.cache.storage.backend, LMCacheBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()  # L1 and L2 forget it; LMCache keeps it
    warm = run(engine, ids, ignore_eos=True)
    assert warm.last.cached_tokens.storage == REUSED
    assert warm.token_ids == cold.token_ids

    lmcache_server.kill()
    try:
        outage_and_return(engine, lmcache_server, ids, cold.token_ids)
    finally:
        if not lmcache_server.running:  # the module's other tests need it
            lmcache_server.restart()
    engine.check_integrity()


def outage_and_return(
    engine: Engine, server: ServerProcess, ids: list[int], cold_tokens: list[int]
) -> None:
    for _ in range(3):
        assert engine.flush_cache()
        began = time.monotonic()
        down = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < 3.0  # recomputed, not waiting on the server
        assert down.last.cached_tokens.total == 0
        assert down.token_ids == cold_tokens

    server.restart()  # an empty store: the next prompt is stored again, then hit
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


def test_lmcache_attached_and_detached_at_run_time_by_name(
    make_engine: Callable[..., Engine], lmcache_extra: dict[str, Any],
) -> None:
    engine = make_engine(*ENGINE_FLAGS)
    assert engine.cache.storage is None
    ids = prompt(21)
    cold = run(engine, ids, ignore_eos=True)
    extra = {**lmcache_extra, "namespace": "engine-attach", "prefetch_threshold": 64}
    engine.attach_storage("lmcache", extra, "wait_complete")
    assert engine.storage_status()["backend"] == "lmcache"
    assert engine.flush_cache()
    first = run(engine, ids, ignore_eos=True)  # computed again, and now backed up
    assert first.token_ids == cold.token_ids
    assert engine.flush_cache()
    warm = run(engine, ids, ignore_eos=True)
    assert warm.last.cached_tokens.storage == REUSED
    assert warm.token_ids == cold.token_ids

    engine.detach_storage()
    assert engine.storage_status()["attached"] is False
    assert engine.flush_cache()
    assert run(engine, ids, ignore_eos=True).last.cached_tokens.total == 0
    # Attached again, the pages the server kept are hits at once.
    engine.attach_storage("lmcache", extra, "wait_complete")
    assert engine.flush_cache()
    again = run(engine, ids, ignore_eos=True)
    assert again.last.cached_tokens.storage == REUSED
    assert again.token_ids == cold.token_ids
    engine.check_integrity()
