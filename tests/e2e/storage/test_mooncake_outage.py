"""A mooncake_master that dies mid-run and comes back (a module of its own: it kills its master).

While the master is down every L3 call must fail at once (the client library
alone would block each call for seconds retrying), the storage controller's
circuit breaker must open, and requests must go on, recomputing. Once the
master is back, L3 must be used again without restarting anything.
"""

from __future__ import annotations

from typing import Any

from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.backends.mooncake.client import WATCH_INTERVAL_S
from hicache.testing.mooncake_master import MasterProcess
from tests.l3_outage_checks import (
    OUTAGE_STORAGE,
    assert_another_cache_finds,
    serve_until_backed_up_again,
    serve_while_the_store_is_down,
)
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    conversation,
    extra_fixture,
    make_cache,
    master_fixture,
    serve_with_l3,
    settle,
)
from tests.waiting import wait_until

# The client's watcher checks the master every WATCH_INTERVAL_S: a guard against a dead
# master that goes unnoticed, generous for a busy machine.
NOTICE_S = 40 * WATCH_INTERVAL_S


def test_a_dead_master_fails_fast_opens_the_breaker_and_l3_returns_after_restart(
    mooncake_master: MasterProcess, mooncake_extra: dict[str, Any],
    mooncake_anchor: MooncakeBackend,
) -> None:
    cache = make_cache(
        mooncake_extra, breaker_failures=2, breaker_backoff_base=0.2, breaker_backoff_max=0.2,
        **OUTAGE_STORAGE,
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
        assert wait_until(lambda: not backend.reachable, NOTICE_S), (
            "the dead master went unnoticed")
        serve_while_the_store_is_down(cache)

        mooncake_master.restart()
        # The restarted master has an empty store, and the client re-registers its
        # memory on its own: keep serving new conversations until one is backed up.
        seed = serve_until_backed_up_again(cache)
        assert cache.stats.num_storage_backed_up_pages == 20
        # Another cache finds that conversation in Mooncake.
        assert_another_cache_finds(make_cache(mooncake_extra), seed)
    finally:
        cache.close()
