"""What the cache tests of a store that dies and comes back share across backends.

While the store is down, new conversations are served as fast as without L3
(misses at once, backups dropped) and the storage controller's breaker opens;
once it is back (empty), serving goes on until a conversation is backed up
again, and another cache finds it there. Every serve goes through the KV oracle
(``tests.kv_oracle``), so the KV always equals cold KV.
"""

from __future__ import annotations

import time

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.storage.breaker import BreakerState
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.waiting import wait_until

# Seeds of new conversations (none stored before) served while the store is down,
# and from which serving goes on once it is back.
_DOWN_SEEDS = range(100, 106)
_BACK_SEED = 200
_TOKENS = 40

# A request served while the store is down must not wait on it. What waiting would cost is
# made far longer than FAST_S: the cache's call deadline and prefetch wait (OUTAGE_STORAGE,
# for the caches these checks serve) and the backends' own timeouts (a minute, set by each
# module; Mooncake's library retries a dead master for over a minute). So a machine slowed
# by other work stays far under the bound, and a request that waits on the store is far over.
FAST_S = 10.0
OUTAGE_STORAGE = {"io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
# Serving until a conversation is backed up again after the restart: a guard against a
# store that is never used again, not a bound on how soon.
RECOVERY_S = 60.0


def serve_while_the_store_is_down(cache: HierarchicalCache, fast_s: float = FAST_S) -> None:
    """New conversations miss and their backups fail, each request within ``fast_s``;
    the breaker opens and nothing more is backed up."""
    assert cache.storage is not None
    backed_up = cache.stats.num_storage_backed_up_pages
    durations = []
    for seed in _DOWN_SEEDS:  # new conversations: lookups miss, backups fail
        began = time.monotonic()
        assert serve_with_l3(cache, conversation(_TOKENS, seed=seed)) == 0
        settle(cache)
        durations.append(time.monotonic() - began)
    assert max(durations) < fast_s, durations
    assert cache.storage.breaker.state is BreakerState.OPEN
    assert cache.storage.backend.stats().failures.get("unreachable", 0) > 0
    assert cache.storage.metrics().failures.get("breaker_open", 0) > 0
    assert cache.stats.num_storage_backed_up_pages == backed_up


def serve_until_backed_up_again(
    cache: HierarchicalCache, recovery_s: float = RECOVERY_S
) -> int:
    """After the store came back: serve new conversations until one is backed up (within
    ``recovery_s``); the breaker is closed again. The seed of that conversation."""
    assert cache.storage is not None
    backed_up = cache.stats.num_storage_backed_up_pages
    seed = _BACK_SEED

    def backed_up_again() -> bool:
        nonlocal seed
        if cache.stats.num_storage_backed_up_pages != backed_up:
            return True
        seed += 1
        serve_with_l3(cache, conversation(_TOKENS, seed=seed))
        settle(cache)
        return False

    assert wait_until(backed_up_again, recovery_s, poll_s=0.05), (
        cache.storage.backend.stats().failures
    )
    assert cache.storage.breaker.state is BreakerState.CLOSED
    return seed


def assert_another_cache_finds(other: HierarchicalCache, seed: int) -> None:
    """``other`` (a new cache on the same store) gets conversation ``seed`` all from L3;
    ``other`` is closed afterwards."""
    try:
        assert serve_with_l3(other, conversation(_TOKENS, seed=seed)) == _TOKENS
        assert other.stats.num_storage_hit_tokens == _TOKENS
        settle(other)
    finally:
        other.close()
