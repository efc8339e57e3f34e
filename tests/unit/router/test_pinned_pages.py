"""Pins in the router's index: a page a worker pinned is a sure host hit there in the
overlaps and in the tier-aware scoring, until the worker unpins it, removes it from its
host tier or is cleared."""

from __future__ import annotations

import asyncio

import pytest

from hicache.events.hashing import page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.types import RouteRequest, TierOverlap, WorkerLoad

PAGE = 4
TOKENS = list(range(100, 100 + 4 * PAGE))
PAGES = page_hashes(TOKENS, PAGE)


def apply(index: PageIndex, worker: str, *events: KVEvent) -> None:
    # Through the wire format, as the subscribers hand batches over.
    index.apply(worker, decode_batch(encode_batch(KVEventBatch(ts=0.0, events=list(events)))))
    index.check_integrity()


def stored(hashes: list[int], medium: str) -> BlockStored:
    return BlockStored(hashes, None, [0] * (PAGE * len(hashes)), PAGE, None, medium)


def test_a_pinned_page_counts_as_held_on_that_workers_host() -> None:
    index = PageIndex()
    apply(index, "w0", stored(PAGES[:1], MEDIUM_GPU))
    # Pinned pages 0-3 on w0 (the pin may come before the landed copy's store event).
    apply(index, "w0", BlockPinned(PAGES, True, MEDIUM_CPU))
    apply(index, "w1", stored(PAGES[:2], MEDIUM_CPU))
    got = index.overlaps(PAGES, ["w0", "w1"])
    assert got["w0"] == TierOverlap(gpu=1, host=4, external=4)
    assert got["w1"] == TierOverlap(gpu=0, host=2, external=2)
    assert index.worker_pinned_pages("w0") == 4 and index.worker_pinned_pages("w1") == 0


def test_unpinning_removing_or_clearing_ends_the_pin() -> None:
    index = PageIndex()
    apply(index, "w0", BlockPinned(PAGES, True, MEDIUM_CPU))
    apply(index, "w0", BlockPinned(PAGES[2:], False, MEDIUM_CPU))
    assert index.overlaps(PAGES, ["w0"])["w0"].host == 2
    # The worker's word on its host tier wins over a pin whose end was not announced.
    apply(index, "w0", BlockRemoved(PAGES[1:2], MEDIUM_CPU))
    assert index.overlaps(PAGES, ["w0"])["w0"].host == 1
    # A device removal leaves a host pin alone (the page is still on the host).
    apply(index, "w0", BlockRemoved(PAGES[:1], MEDIUM_GPU))
    assert index.overlaps(PAGES, ["w0"])["w0"].host == 1
    apply(index, "w0", AllBlocksCleared())
    assert index.overlaps(PAGES, ["w0"])["w0"] == TierOverlap()
    apply(index, "w1", BlockPinned(PAGES, True, MEDIUM_CPU))
    index.remove_worker("w1")
    index.check_integrity()
    assert index.overlaps(PAGES, ["w1"])["w1"] == TierOverlap()


def test_a_pin_in_the_shared_pool_says_the_page_is_there() -> None:
    index = PageIndex()
    apply(index, "w0", BlockPinned(PAGES[:3], True, MEDIUM_EXTERNAL))
    assert index.overlaps(PAGES, ["w0", "w1"])["w1"] == TierOverlap(external=3)


def test_scoring_prefers_the_worker_that_pinned_the_prefix() -> None:
    """w0 computed the prefix long ago and its host copy is pinned; w1 has only the first
    page on device. The pinned host pages count as host hits for w0."""
    index = PageIndex()
    apply(index, "w0", BlockPinned(PAGES, True, MEDIUM_CPU))
    apply(index, "w1", stored(PAGES[:1], MEDIUM_GPU))
    request = RouteRequest(page_hashes=PAGES, prompt_tokens=len(TOKENS), page_size=PAGE,
                           workers=[WorkerLoad("w1"), WorkerLoad("w0")])
    policy = build_policy("tier_aware", index, None, ScoringConfig())
    decision = asyncio.run(policy.choose(request, TOKENS))
    # w0: (16 - 0.9 * 4 * 4) / 4 = 0.4; w1: (16 - 4) / 4 = 3
    assert decision.logits["w0"] == pytest.approx(0.4)
    assert decision.logits["w1"] == pytest.approx(3.0)
    assert decision.worker == "w0"
