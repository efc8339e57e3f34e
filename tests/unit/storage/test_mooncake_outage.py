"""A mooncake_master that dies mid-run and comes back (a module of its own: it kills its master).

While the master is down every L3 call must fail at once (the client library
alone would block each call for seconds retrying), the storage controller's
circuit breaker must open, and requests must go on, recomputing. Once the
master is back, L3 must be used again without restarting anything.
"""

from __future__ import annotations

import time
from typing import Any

from hicache.storage.breaker import BreakerState
from hicache.storage.mooncake import MooncakeBackend
from hicache.storage.mooncake_client import WATCH_INTERVAL_S
from hicache.storage.mooncake_master import MasterProcess
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    conversation,
    extra_fixture,
    make_cache,
    master_fixture,
    serve_with_l3,
    settle,
)

# Per request while the master is down: lookups and backups must not wait on it.
FAST_S = 0.5
RECOVERY_S = 15.0


def test_a_dead_master_fails_fast_opens_the_breaker_and_l3_returns_after_restart(
    mooncake_master: MasterProcess, mooncake_extra: dict[str, Any],
    mooncake_anchor: MooncakeBackend,
) -> None:
    cache = make_cache(
        mooncake_extra, breaker_failures=2, breaker_backoff_base=0.2, breaker_backoff_max=0.2,
    )
    try:
        assert cache.storage is not None
        backend = cache.storage.backend
        assert isinstance(backend, MooncakeBackend) and backend.reachable
        serve_with_l3(cache, conversation(40, seed=1))
        settle(cache)
        assert cache.stats.num_storage_backed_up_pages == 10

        mooncake_master.kill()
        # The client's watcher notices within its interval; from then on no call
        # enters the library (whose own retries would block each one for seconds).
        deadline = time.monotonic() + 5 * WATCH_INTERVAL_S
        while backend.reachable:
            assert time.monotonic() < deadline, "the dead master went unnoticed"
            time.sleep(0.01)
        durations = []
        for seed in range(100, 106):  # new conversations: lookups miss, backups fail
            began = time.monotonic()
            assert serve_with_l3(cache, conversation(40, seed=seed)) == 0
            settle(cache)
            durations.append(time.monotonic() - began)
        assert max(durations) < FAST_S, durations
        assert cache.storage.breaker.state is BreakerState.OPEN
        assert backend.stats().failures.get("unreachable", 0) > 0
        assert cache.storage.metrics().failures.get("breaker_open", 0) > 0
        assert cache.stats.num_storage_backed_up_pages == 10

        mooncake_master.restart()
        # The restarted master has an empty store, and the client re-registers its
        # memory on its own: keep serving new conversations until one is backed up.
        deadline = time.monotonic() + RECOVERY_S
        seed = 200
        while cache.stats.num_storage_backed_up_pages == 10:
            assert time.monotonic() < deadline, backend.stats().failures
            seed += 1
            serve_with_l3(cache, conversation(40, seed=seed))
            settle(cache)
            time.sleep(0.05)
        assert cache.storage.breaker.state is BreakerState.CLOSED
        assert cache.stats.num_storage_backed_up_pages == 20
        # Another cache finds that conversation in Mooncake.
        other = make_cache(mooncake_extra)
        try:
            assert serve_with_l3(other, conversation(40, seed=seed)) == 40
            assert other.stats.num_storage_hit_tokens == 40
            settle(other)
        finally:
            other.close()
    finally:
        cache.close()
