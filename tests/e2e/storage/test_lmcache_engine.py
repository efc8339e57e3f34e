"""The engine over a real lmcache_server as L3: greedy tokens equal a cold run's whether pages
come from LMCache, are recomputed while the server is down, or come back after it restarts;
and L3 attached and detached at run time by name (the admin endpoints' path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.engine.engine import Engine
from hicache.storage.backends.lmcache.backend import LMCacheBackend
from hicache.testing.lmcache_server import LMCacheServerProcess
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.l3_engine_checks import (
    ENGINE_FLAGS,
    FAST_BREAKER,
    assert_hit_after_flush,
    assert_recomputed_while_down,
    assert_stored_and_hit_again,
    l3_engine_flags,
)
from tests.lmcache_fixtures import extra_fixture, server_fixture  # noqa: F401 - fixtures

# A client that waited on the dead server would wait out these timeouts, far past the
# bound on a request while it is down (l3_engine_checks.DOWN_S).
PATIENT_CLIENT = {"timeout_s": 60.0, "connect_timeout_s": 60.0}


def test_engine_outputs_equal_cold_while_the_server_dies_and_returns(
    make_engine: Callable[..., Engine], lmcache_server: LMCacheServerProcess,
    lmcache_extra: dict[str, Any],
) -> None:
    extra = {**lmcache_extra, "namespace": "engine-outage", "retry_interval_s": 0.1,
             **PATIENT_CLIENT}
    engine = make_engine(*l3_engine_flags("lmcache", {**extra, **FAST_BREAKER}))
    assert engine.cache.storage is not None, engine.cache.storage_error
    assert isinstance(engine.cache.storage.backend, LMCacheBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from LMCache

    lmcache_server.kill()
    try:
        assert_recomputed_while_down(engine, ids, cold.token_ids)
        lmcache_server.restart()  # an empty store: the next prompt is stored again, then hit
        assert_stored_and_hit_again(engine)
    finally:
        if not lmcache_server.running:  # the module's other tests need it
            lmcache_server.restart()
    engine.check_integrity()


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
    assert_hit_after_flush(engine, ids, cold.token_ids)

    engine.detach_storage()
    assert engine.storage_status()["attached"] is False
    assert engine.flush_cache()
    assert run(engine, ids, ignore_eos=True).last.cached_tokens.total == 0
    # Attached again, the pages the server kept are hits at once.
    engine.attach_storage("lmcache", extra, "wait_complete")
    assert_hit_after_flush(engine, ids, cold.token_ids)
    engine.check_integrity()
