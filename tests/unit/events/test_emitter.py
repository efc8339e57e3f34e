"""The emitter on a real HierarchicalCache: the event stream, replayed, is the cache's state.

A router builds a per-tier index from the events; after any workload (every
write policy, splits, evictions under pressure, load-backs) that index must
hold exactly the hashes of the pages on the device and of the host copies
that have landed. Plus the transitions the scripted engine test does not
reach, and that nothing is hashed when events are off.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, WritePolicy
from hicache.events.emitter import KVEventEmitter
from hicache.events.hashing import digest_to_hash, page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from hicache.memory.geometry import KVGeometry
from hicache.radix.keys import unpack_tokens
from tests.kv_oracle import serve

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
HEADS = [[7, 1, 2, 3, 4, 5], [8] * 9, [9, 3] * 7, list(range(20, 36)), [1]]
prompts = st.lists(
    st.tuples(st.integers(0, len(HEADS) - 1), st.lists(st.integers(0, 3), max_size=8)).map(
        lambda pick: HEADS[pick[0]] + pick[1]
    ),
    min_size=1, max_size=25,
)


class Collected:
    """A publisher that keeps the batches (the ZMQ one is tested on its own)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def close(self) -> None:
        pass

    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]


class TierIndex:
    """What a router knows from the events: each tier's page hashes (counted, to
    catch a page stored twice or removed when absent)."""

    def __init__(self) -> None:
        self.tiers: dict[str, Counter[int]] = {MEDIUM_GPU: Counter(), MEDIUM_CPU: Counter()}

    def apply(self, event: object) -> None:
        if isinstance(event, AllBlocksCleared):
            for tier in self.tiers.values():
                tier.clear()
        elif isinstance(event, BlockStored) and event.medium in self.tiers:
            tier = self.tiers[event.medium]
            for h in event.block_hashes:
                assert tier[h] == 0, f"page {h} stored twice in {event.medium}"
                tier[h] = 1
        elif isinstance(event, BlockRemoved) and event.medium in self.tiers:
            tier = self.tiers[event.medium]
            for h in event.block_hashes:
                assert tier.pop(h, 0) == 1, f"page {h} removed from {event.medium} unseen"


def cache_tiers(cache: HierarchicalCache) -> dict[str, set[int]]:
    """Each tier's page hashes, computed from the tree's token ids from scratch."""
    tiers: dict[str, set[int]] = {MEDIUM_GPU: set(), MEDIUM_CPU: set()}
    for node in cache.tree.iter_nodes():
        path: list[int] = []
        cursor = node
        while cursor.parent is not None:
            path[:0] = unpack_tokens(cursor.tokens).tolist()
            cursor = cursor.parent
        own = page_hashes(path, cache.page_size)[-(node.num_tokens // cache.page_size):]
        if node.device_pages is not None:
            tiers[MEDIUM_GPU].update(own)
        if node.host_pages is not None:
            tiers[MEDIUM_CPU].update(own)
    return tiers


def make_cache(
    policy: WritePolicy, page_size: int, device_pages: int, events: bool = True,
) -> tuple[HierarchicalCache, Collected]:
    config = CacheConfig(
        page_size=page_size, enable_hierarchical_cache=True, hicache_ratio=2.0,
        write_policy=policy, io_backend=IOBackendKind.DIRECT, load_back_threshold_tokens=1,
    )
    sink = Collected()
    emitter = KVEventEmitter(page_size, sink) if events else None
    return HierarchicalCache(config, GEOMETRY, device_pages, events=emitter), sink


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", list(WritePolicy))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=prompts)
def test_the_events_replayed_are_the_cache_tiers(
    page_size: int, policy: WritePolicy, requests: list[list[int]],
) -> None:
    cache, sink = make_cache(policy, page_size, 12 // page_size + 2)
    try:
        index = TierIndex()
        for tokens in requests:
            serve(cache, tokens)
            cache.publish_events()
        cache.poll(wait=True)
        cache.publish_events()
        for event in sink.events():
            index.apply(event)
        want = cache_tiers(cache)
        assert set(index.tiers[MEDIUM_GPU]) == want[MEDIUM_GPU]
        assert set(index.tiers[MEDIUM_CPU]) == want[MEDIUM_CPU]
        cache.flush()
        cache.publish_events()
        assert sink.events()[-1] == AllBlocksCleared()
    finally:
        cache.close()


def test_store_in_the_new_tier_precedes_removal_from_the_old() -> None:
    # write_back: the eviction copies the page to the host, waits for the copy, then
    # drops the device copy, all within one step (one batch).
    cache, sink = make_cache(WritePolicy.WRITE_BACK, page_size=4, device_pages=4)
    try:
        tokens = list(range(16))
        serve(cache, tokens)
        cache.publish_events()
        sink.batches.clear()
        serve(cache, list(range(100, 116)))  # needs every device page: evicts the first
        cache.publish_events()
        hashes = page_hashes(tokens, 4)
        first = [e for e in sink.batches[0].events
                 if getattr(e, "block_hashes", None) == hashes]
        assert [(type(e).__name__, e.medium) for e in first] == [  # type: ignore[attr-defined]
            ("BlockStored", MEDIUM_CPU), ("BlockRemoved", MEDIUM_GPU),
        ]
        assert len(sink.batches) == 1
    finally:
        cache.close()


def test_a_device_only_page_evicted_is_removed_from_the_device() -> None:
    # write_through_selective copies a page to the host on its second hit only.
    cache, sink = make_cache(WritePolicy.WRITE_THROUGH_SELECTIVE, page_size=4, device_pages=4)
    try:
        serve(cache, list(range(16)))
        serve(cache, list(range(100, 116)))  # evicts the first prompt's pages
        cache.publish_events()
        hashes = page_hashes(list(range(16)), 4)
        assert sink.events()[:2] == [
            BlockStored(hashes, None, list(range(16)), 4, None, MEDIUM_GPU),
            BlockRemoved(hashes, MEDIUM_GPU),
        ]
    finally:
        cache.close()


def test_a_node_split_keeps_its_digests_and_a_child_chains_from_them() -> None:
    cache, sink = make_cache(WritePolicy.WRITE_THROUGH, page_size=2, device_pages=16)
    try:
        serve(cache, [1, 2, 3, 4, 5, 6])
        serve(cache, [1, 2, 3, 4, 9, 9])  # splits the first node after two pages
        cache.publish_events()
        node = cache.tree.match_prefix([1, 2, 3, 4]).last_node
        assert node.event_digests is not None
        assert [digest_to_hash(d) for d in node.event_digests] == page_hashes([1, 2, 3, 4], 2)
        child = next(e for e in sink.events()
                     if isinstance(e, BlockStored) and e.token_ids == [9, 9])
        assert child.parent_block_hash == page_hashes([1, 2, 3, 4], 2)[-1]
        assert child.block_hashes == page_hashes([1, 2, 3, 4, 9, 9], 2)[-1:]
    finally:
        cache.close()


def test_nothing_is_hashed_when_events_are_off() -> None:
    cache, _ = make_cache(WritePolicy.WRITE_THROUGH, page_size=4, device_pages=6, events=False)
    try:
        for start in (0, 100, 200, 0):
            serve(cache, list(range(start, start + 12)))
        cache.poll(wait=True)
        assert cache.tree.observer is None
        assert all(node.event_digests is None for node in cache.tree.iter_nodes())
    finally:
        cache.close()


def test_a_step_without_events_publishes_nothing() -> None:
    cache, sink = make_cache(WritePolicy.WRITE_THROUGH, page_size=4, device_pages=6)
    try:
        cache.publish_events()
        assert sink.batches == []
    finally:
        cache.close()
