"""The warm's outcome logic (``cache/warm.py``): ``settle_outcome`` for each way a
prefetch can end, and ``L3Warm`` over a stand-in cache: items in order within the host
fraction (clipped past it, nothing once it is used up), a prefix already cached, too
short, or refused; items deferred behind a prefetch of the same first page or a full
L3 in-flight budget; ``stop`` settles what is in flight keeping what landed."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.cache.warm import L3Warm, WarmOutcome, settle_outcome

PAGE = 4


@pytest.mark.parametrize(("args", "outcome", "reason"), [
    ((8, 8, 8, 8, False), WarmOutcome.WARMED, ""),
    ((8, 8, 4, 4, False), WarmOutcome.WARMED, "L3 holds only the first 4 of the 8"),
    ((8, 4, 4, 4, False), WarmOutcome.CLIPPED, "the host fraction allowed 4 of the 8"),
    ((8, 8, 8, 4, False), WarmOutcome.CLIPPED, "4 of the 8 tokens L3 holds landed (no host"),
    ((8, 8, 8, 4, True), WarmOutcome.CLIPPED, "4 of the 8 tokens L3 holds landed (timed out"),
    ((8, 8, 0, 0, False), WarmOutcome.NOT_IN_L3, "L3 holds none of the 8 tokens"),
    ((8, 8, -1, 0, True), WarmOutcome.CLIPPED, "timed out before L3 answered"),
])
def test_settle_outcome(args: tuple[int, int, int, int, bool], outcome: WarmOutcome,
                        reason: str) -> None:
    missing, asked, found, inserted, timed_out = args
    got, why = settle_outcome(missing_tokens=missing, asked_tokens=asked, found_tokens=found,
                              inserted_tokens=inserted, timed_out=timed_out)
    assert got is outcome
    assert why.startswith(reason)


@dataclass
class Handle:
    tokens: list[int]
    found: int  # tokens L3 holds of the asked ones (-1: lookup not answered)
    done: bool = False
    landed: int | None = None  # tokens landed (None: all found)

    @property
    def num_found_tokens(self) -> int:
        return self.found


@dataclass
class FakeCache:
    """What ``L3Warm`` uses of ``HierarchicalCache``: L3 holds ``in_l3`` tokens of each
    prompt (by its first token), ``cached`` pages are in L1/L2 already."""

    host_pages: int = 100
    in_l3: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    tier_budget: int = 1000
    threshold: int = PAGE
    started: list[Handle] = field(default_factory=list)
    page_size: int = PAGE
    prefetch_slot_free: bool = True

    def __post_init__(self) -> None:
        self.host_pool = SimpleNamespace(num_pages=self.host_pages)
        self.storage = SimpleNamespace(
            prefetch_budget_pages=self.tier_budget, num_in_flight_prefetch_pages=0,
            config=SimpleNamespace(prefetch_threshold=self.threshold),
        )

    def peek(self, tokens: list[int], extra_key: str | None = None) -> Any:
        return SimpleNamespace(num_device_pages=0, num_host_pages=self.cached.get(tokens[0], 0))

    def prefetch(self, tokens: list[int], extra_key: str | None = None) -> Handle | None:
        local = self.cached.get(tokens[0], 0) * PAGE
        asked = len(tokens) // PAGE * PAGE - local
        if asked < self.threshold:
            return None
        handle = Handle(tokens, min(asked, max(0, self.in_l3.get(tokens[0], 0) - local)))
        self.started.append(handle)
        self.storage.num_in_flight_prefetch_pages += asked // PAGE
        return handle

    def prefetch_done(self, handle: Handle) -> bool:
        return handle.done

    def prefetch_pages(self, handle: Handle) -> int:
        return (handle.found if handle.found >= 0 else len(handle.tokens)) // PAGE

    def finish_prefetch(self, handle: Handle) -> int:
        return handle.found if handle.landed is None else handle.landed


def start(cache: FakeCache, items: list[list[int]], fraction: float) -> L3Warm:
    return L3Warm(cast(HierarchicalCache, cache), items, fraction)


def prompt(first: int, pages: int) -> list[int]:
    return [first] + [0] * (pages * PAGE - 1)


def results(progress: dict[str, Any]) -> list[tuple[str, int]]:
    return [(r["outcome"], r["tokens"]) for r in progress["results"]]


def test_items_are_warmed_in_order_within_the_host_fraction() -> None:
    cache = FakeCache(host_pages=20, in_l3={1: 40, 2: 40, 3: 40, 4: 40})
    warm = start(cache, [prompt(1, 4), prompt(2, 4), prompt(3, 4), prompt(4, 4)], 0.5)
    assert warm.budget_pages == 10

    warm.step()

    assert [len(h.tokens) for h in cache.started] == [16, 16, 8]  # 4 + 4 + 2 pages
    for handle in cache.started:
        handle.done = True
    progress = warm.step()
    assert progress["done"]
    assert results(progress) == [("warmed", 16), ("warmed", 16), ("clipped", 8), ("clipped", 0)]
    assert progress["results"][3]["reason"] == "the host fraction is used up"


def test_room_a_short_find_leaves_is_given_to_later_items() -> None:
    cache = FakeCache(host_pages=12, in_l3={1: 4, 2: 40})
    warm = start(cache, [prompt(1, 4), prompt(2, 4)], 0.5)  # 6 pages
    warm.step()
    # L3 holds one page of the first: it holds one of the budget, the second gets four.
    assert len(cache.started) == 2 and len(cache.started[1].tokens) == 4 * PAGE
    for handle in cache.started:
        handle.done = True
    assert results(warm.step()) == [("warmed", 4), ("warmed", 16)]


def test_a_lookup_not_answered_holds_what_it_asked_for() -> None:
    cache = FakeCache(host_pages=12, in_l3={1: 16, 2: 40})
    warm = start(cache, [prompt(1, 4), prompt(2, 4)], 0.5)  # 6 pages
    original = cache.prefetch

    def unanswered(tokens: list[int], extra_key: str | None = None) -> Handle | None:
        handle = original(tokens)
        if handle is not None:
            handle.found = -1
        return handle

    cache.prefetch = unanswered  # type: ignore[method-assign]
    warm.step()
    assert len(cache.started) == 2 and len(cache.started[1].tokens) == 2 * PAGE


def test_cached_short_and_refused_items_end_at_once() -> None:
    cache = FakeCache(cached={1: 4}, threshold=3 * PAGE)
    warm = start(cache, [prompt(1, 4), [7, 8], prompt(3, 2)], 0.5)
    progress = warm.step()
    assert progress["done"]
    assert [(r["outcome"], r["reason"]) for r in progress["results"]] == [
        ("warmed", "already cached"),
        ("rejected", f"shorter than one page ({PAGE} tokens)"),
        ("rejected", f"{2 * PAGE} tokens to fetch, under the L3 prefetch threshold "
                     f"({3 * PAGE})"),
    ]


def test_an_item_waits_behind_a_prefetch_of_its_first_page() -> None:
    cache = FakeCache(in_l3={1: 32})
    warm = start(cache, [prompt(1, 4), prompt(1, 8)], 1.0)
    warm.step()
    assert len(cache.started) == 1
    cache.started[0].done = True
    cache.cached[1] = 4  # what landed is in the tree now
    warm.step()
    assert len(cache.started) == 2 and len(cache.started[1].tokens) == 8 * PAGE
    cache.started[1].done = True
    assert results(warm.step()) == [("warmed", 16), ("warmed", 16)]


def test_items_wait_for_room_in_the_tiers_in_flight_budget() -> None:
    cache = FakeCache(in_l3={1: 16, 2: 16}, tier_budget=5)
    warm = start(cache, [prompt(1, 4), prompt(2, 4)], 1.0)
    warm.step()  # the first one's read takes 4 of the tier's 5 pages
    assert len(cache.started) == 1
    cache.started[0].done = True
    warm.step()
    assert len(cache.started) == 2


def test_stop_keeps_what_landed_and_clips_what_never_started() -> None:
    cache = FakeCache(in_l3={1: 16, 2: 16}, tier_budget=4)
    warm = start(cache, [prompt(1, 4), prompt(2, 4)], 1.0)
    warm.step()
    assert len(cache.started) == 1
    cache.started[0].landed = 8
    progress = warm.stop()
    assert progress["done"]
    assert results(progress) == [("clipped", 8), ("clipped", 0)]
    assert progress["results"][1]["reason"] == "timed out before its prefetch started"
