"""PageIndex: per-worker, per-tier residency from KV events, and prefix overlaps."""

from __future__ import annotations

import random

import pytest

from hicache.events.hashing import page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from hicache.router.index import PageIndex, UnknownMediumError
from hicache.router.types import TierOverlap

PAGE = 4


def stored(hashes: list[int], medium: str | None) -> BlockStored:
    return BlockStored(hashes, None, [0] * (PAGE * len(hashes)), PAGE, None, medium)


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    # Through the wire format, as the subscribers hand batches over.
    return decode_batch(encode_batch(KVEventBatch(ts=0.0, events=list(events))))


def test_tiers_are_counted_from_the_top() -> None:
    pages = page_hashes(list(range(8 * PAGE)), PAGE)
    index = PageIndex()
    index.apply("w0", batch(stored(pages[:2], MEDIUM_GPU), stored(pages[2:5], MEDIUM_CPU)))
    index.apply("w1", batch(stored(pages[:1], MEDIUM_CPU), stored(pages[1:3], MEDIUM_GPU)))
    index.apply("w2", batch(stored(pages[:6], MEDIUM_EXTERNAL)))
    got = index.overlaps(pages, ["w0", "w1", "w2", "unknown"])
    # The shared pool (w2 stored pages 0-5 there) counts for every known worker.
    assert got["w0"] == TierOverlap(gpu=2, host=5, external=6)
    # w1's device pages start at page 1: its device prefix is empty.
    assert got["w1"] == TierOverlap(gpu=0, host=3, external=6)
    assert got["w2"] == TierOverlap(gpu=0, host=0, external=6)
    # A worker that sent nothing yet still reaches the shared pool.
    assert got["unknown"] == TierOverlap(external=6)
    # Entries per tier: device pages 0-2, host pages 0 and 2-4, shared pages 0-5.
    assert index.num_pages() == 3 + 4 + 6
    index.check_integrity()


def test_a_page_on_device_and_host_survives_losing_one_copy() -> None:
    pages = page_hashes(list(range(3 * PAGE)), PAGE)
    index = PageIndex()
    # Store the new tier before removing the old: the page is never invisible.
    index.apply("w", batch(stored(pages, MEDIUM_GPU), stored(pages, MEDIUM_CPU),
                           BlockRemoved(pages[1:], MEDIUM_GPU)))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap(gpu=1, host=3, external=3)
    index.apply("w", batch(BlockRemoved(pages[2:], MEDIUM_CPU)))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap(gpu=1, host=2, external=2)
    # Load-back: the page is on the device again.
    index.apply("w", batch(stored(pages[1:2], MEDIUM_GPU)))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap(gpu=2, host=2, external=2)
    index.check_integrity()


def test_an_event_without_medium_is_a_device_event_and_cpu_is_host() -> None:
    pages = page_hashes(list(range(2 * PAGE)), PAGE)
    index = PageIndex()
    index.apply("w", batch(stored(pages[:1], None), stored(pages[1:], "CPU")))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap(gpu=1, host=2, external=2)


def test_an_unknown_medium_is_refused_and_changes_nothing() -> None:
    pages = page_hashes(list(range(2 * PAGE)), PAGE)
    index = PageIndex()
    with pytest.raises(UnknownMediumError, match="'NVME'"):
        index.apply("w", batch(stored(pages[:1], MEDIUM_GPU), stored(pages[1:], "NVME")))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap()
    assert index.num_pages() == 0


def test_clearing_and_removing_a_worker_free_its_pages_only() -> None:
    pages = page_hashes(list(range(4 * PAGE)), PAGE)
    index = PageIndex()
    index.apply("a", batch(stored(pages, MEDIUM_GPU), stored(pages[:2], MEDIUM_CPU)))
    index.apply("b", batch(stored(pages[:3], MEDIUM_GPU), stored(pages[3:], MEDIUM_EXTERNAL)))
    index.apply("a", batch(AllBlocksCleared()))
    got = index.overlaps(pages, ["a", "b"])
    assert got["a"] == TierOverlap()  # page 0 is nowhere a can reach: the walk stops there
    assert got["b"] == TierOverlap(gpu=3, host=3, external=4)
    assert index.worker_pages("a") == {MEDIUM_GPU: 0, MEDIUM_CPU: 0}
    index.remove_worker("b")
    assert index.overlaps(pages, ["b"])["b"] == TierOverlap()
    assert index.overlaps(pages[3:], ["b"])["b"] == TierOverlap(external=1)
    # The shared pool is not b's own: its page stays known.
    assert index.num_pages() == 1
    # A new worker reuses b's bit and sees none of b's pages.
    index.apply("c", batch(stored(pages[:1], MEDIUM_CPU)))
    assert index.overlaps(pages, ["c"])["c"] == TierOverlap(gpu=0, host=1, external=1)
    index.clear_worker("c")
    index.clear_worker("never-seen")
    index.remove_worker("never-seen")
    assert index.num_pages() == 1
    index.check_integrity()


def test_the_shared_set_is_capped_oldest_first() -> None:
    pages = page_hashes(list(range(5 * PAGE)), PAGE)
    index = PageIndex(max_external_pages=3)
    index.apply("w", batch(stored(pages[:3], MEDIUM_EXTERNAL)))
    index.apply("w", batch(stored(pages[0:1], MEDIUM_EXTERNAL)))  # page 0 now newest
    index.apply("w", batch(stored(pages[3:5], MEDIUM_EXTERNAL)))  # forgets pages 1 and 2
    assert index.num_pages() == 3
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap(external=1)
    index.apply("w", batch(BlockRemoved(pages[:1], MEDIUM_EXTERNAL)))
    assert index.overlaps(pages, ["w"])["w"] == TierOverlap()
    with pytest.raises(ValueError, match="positive"):
        PageIndex(max_external_pages=0)


def _reference(
    held: dict[tuple[str, str], set[int]], external: set[int], pages: list[int], worker: str,
) -> TierOverlap:
    def prefix(present: set[int]) -> int:
        count = 0
        for page in pages:
            if page not in present:
                break
            count += 1
        return count

    gpu = held.get((worker, MEDIUM_GPU), set())
    host = gpu | held.get((worker, MEDIUM_CPU), set())
    return TierOverlap(prefix(gpu), prefix(host), prefix(host | external))


@pytest.mark.parametrize("seed", range(5))
def test_random_event_streams_match_a_naive_model(seed: int) -> None:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(5)]
    pages = page_hashes(list(range(12 * PAGE)), PAGE)
    index = PageIndex()
    held: dict[tuple[str, str], set[int]] = {}
    external: set[int] = set()
    for _ in range(300):
        worker = rng.choice(workers)
        roll = rng.random()
        if roll < 0.03:
            index.remove_worker(worker)
            held.pop((worker, MEDIUM_GPU), None)
            held.pop((worker, MEDIUM_CPU), None)
        elif roll < 0.06:
            index.apply(worker, batch(AllBlocksCleared()))
            held.pop((worker, MEDIUM_GPU), None)
            held.pop((worker, MEDIUM_CPU), None)
        else:
            medium = rng.choice([MEDIUM_GPU, MEDIUM_CPU, MEDIUM_EXTERNAL])
            start = rng.randrange(len(pages))
            chosen = pages[start:start + rng.randint(1, 4)]
            if rng.random() < 0.6:
                index.apply(worker, batch(stored(chosen, medium)))
                target = external if medium == MEDIUM_EXTERNAL else held.setdefault(
                    (worker, medium), set())
                target.update(chosen)
            elif medium != MEDIUM_EXTERNAL:
                index.apply(worker, batch(BlockRemoved(chosen, medium)))
                held.get((worker, medium), set()).difference_update(chosen)
        request = pages[: rng.randint(0, len(pages))]
        got = index.overlaps(request, workers)
        for name in workers:
            assert got[name] == _reference(held, external, request, name), name
    index.check_integrity()
