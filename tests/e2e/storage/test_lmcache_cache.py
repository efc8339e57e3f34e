"""The cache over a real lmcache_server as L3: KV one instance stores, the next one reuses bit
for bit (tests/kv_oracle.py), and a server that dies opens the breaker without slowing
requests, then is used again once it is back.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.config import MemLayout
from hicache.testing.lmcache_server import LMCacheServerProcess, start_server
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.l3_caches import assert_a_new_cache_reuses
from tests.l3_outage_checks import (
    OUTAGE_STORAGE,
    assert_another_cache_finds,
    serve_until_backed_up_again,
    serve_while_the_store_is_down,
)
from tests.lmcache_fixtures import PROGRAM, make_cache

# A client that waited on the dead server would wait out these timeouts, far past the
# bound on a request while it is down (l3_outage_checks.FAST_S).
PATIENT_CLIENT = {"timeout_s": 60.0, "connect_timeout_s": 60.0}


@pytest.fixture(scope="module", name="server")
def server_fixture() -> Iterator[LMCacheServerProcess]:
    with start_server(program=PROGRAM) as server:
        yield server


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_a_new_instance_reuses_the_kv_the_last_one_stored(
    server: LMCacheServerProcess, layout: MemLayout
) -> None:
    extra = {"remote_url": server.url, "namespace": f"reuse-{layout.value}"}
    assert_a_new_cache_reuses(lambda: make_cache(extra, layout=layout), conversation(40, seed=7))


def test_a_dead_server_opens_the_breaker_and_l3_returns_after_restart(
    server: LMCacheServerProcess,
) -> None:
    extra = {"remote_url": server.url, "namespace": "outage", "retry_interval_s": 0.1,
             **PATIENT_CLIENT}
    cache = make_cache(
        extra, breaker_failures=2, breaker_backoff_base=0.2, breaker_backoff_max=0.2,
        **OUTAGE_STORAGE,
    )
    try:
        assert cache.storage is not None
        serve_with_l3(cache, conversation(40, seed=1))
        settle(cache)
        assert cache.stats.num_storage_backed_up_pages == 10

        server.kill()
        serve_while_the_store_is_down(cache)

        server.restart()  # empty: keep serving new conversations until one is backed up
        seed = serve_until_backed_up_again(cache)
        assert_another_cache_finds(make_cache(extra), seed)
    finally:
        cache.close()
