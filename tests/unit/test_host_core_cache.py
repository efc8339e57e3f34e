"""The host tier's core set on a real cache (L1 + L2): conversations taking turns in a loop
larger than the host pool keep hitting with a core set and never without one, and every
page served from the cache is the KV a cold prefill writes."""

from __future__ import annotations

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, ConfigError
from hicache.memory.geometry import KVGeometry
from tests.kv_oracle import conversation, serve

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 2
DEVICE_PAGES = 16
HOST_PAGES = 40
CONVERSATIONS = 5
TURN_TOKENS = 4  # two pages a turn


def loop_hits(core_fraction: float, rounds: int = 8) -> tuple[list[int], int]:
    """Hit tokens per round of five conversations taking turns, and the core set's size."""
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1, host_core_fraction=core_fraction,
    )
    cache = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        hits = []
        for r in range(1, rounds + 1):
            total = 0
            for c in range(CONVERSATIONS):
                total += serve(cache, conversation(TURN_TOKENS * r, seed=c + 1))
                cache.poll(wait=True)  # the copies to the host land before the next turn
            hits.append(total)
        cache.check_integrity()
        return hits, cache.tree.num_core_pages
    finally:
        cache.close()


def test_without_a_core_set_a_loop_larger_than_the_host_never_hits() -> None:
    hits, core = loop_hits(0.0)
    assert core == 0
    # Round 5 needs 5 x 10 = 50 pages against 40: from round 6 on each turn's history
    # was evicted by the turns before it.
    assert hits[5:] == [0, 0, 0]


@pytest.mark.parametrize("fraction", [0.5, 0.75])
def test_a_core_set_keeps_hitting_under_the_same_loop(fraction: float) -> None:
    hits, core = loop_hits(fraction)
    assert core == int(fraction * HOST_PAGES)
    # Every core page hits each round (serve() checked each one against the cold KV).
    assert hits[5:] == [core * PAGE] * 3, hits


def test_the_fraction_is_checked() -> None:
    with pytest.raises(ConfigError, match="--hicache-core-fraction"):
        CacheConfig(host_core_fraction=1.0)
    with pytest.raises(ConfigError, match="--hicache-core-fraction"):
        CacheConfig(host_core_fraction=-0.1)
