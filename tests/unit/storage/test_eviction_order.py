"""The file store's loop-resistant eviction order (``eviction_order``): under a cyclic
reuse larger than the store, plain LRU never hits while the core set's pages hit every
round; the set follows a workload that moves on; its invariants hold under random use."""

from __future__ import annotations

import itertools
import random

import pytest

from hicache.storage.backends.file.eviction_order import EvictionOrder

PAGE = 10  # bytes of every page here


class Store:
    """A store of ``capacity`` pages evicting in ``EvictionOrder``; counts hits."""

    def __init__(self, capacity: int, core_pages: int) -> None:
        self.capacity = capacity
        self.order = EvictionOrder(core_pages * PAGE)
        self.clock = itertools.count(1)
        self.hits = 0

    def access(self, name: str) -> bool:
        if name in self.order:
            self.order.use(name, next(self.clock))
            self.hits += 1
            return True
        while self.order.total_bytes + PAGE > self.capacity * PAGE:
            oldest = self.order.pop_oldest()
            assert oldest is not None
            self.order.remember(oldest[0], oldest[2])
        self.order.write(name, PAGE, next(self.clock))
        self.order.check()
        return False

    def loop_round(self, names: list[str]) -> int:
        before = self.hits
        for name in names:
            self.access(name)
        return self.hits - before


def pages(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{index}" for index in range(count)]


def test_under_a_loop_larger_than_the_store_lru_never_hits() -> None:
    store = Store(capacity=8, core_pages=0)
    loop = pages("a", 12)
    assert [store.loop_round(loop) for _ in range(5)] == [0] * 5


def test_under_a_loop_the_core_set_hits_every_round() -> None:
    store = Store(capacity=8, core_pages=6)
    loop = pages("a", 12)
    assert store.loop_round(loop) == 0
    # The pages that filled the set first are kept; the rest churn outside it.
    assert [store.loop_round(loop) for _ in range(5)] == [6] * 5
    assert all(store.order.in_core(name) for name in loop[:6])


def test_the_core_set_follows_a_workload_that_moved_on() -> None:
    store = Store(capacity=8, core_pages=6)
    first, second = pages("a", 12), pages("b", 12)
    for _ in range(3):
        store.loop_round(first)
    # The new loop's pages come back sooner than the old core pages were last used:
    # computed again, their kept history lets them in.
    hits = [store.loop_round(second) for _ in range(4)]
    assert hits[0] == 0 and hits[-1] == 6
    assert not any(store.order.in_core(name) for name in first)


def test_a_page_read_again_joins_when_it_came_back_sooner_than_the_core() -> None:
    order = EvictionOrder(2 * PAGE)
    for stamp, name in enumerate(["a", "b", "c"], start=1):
        order.write(name, PAGE, stamp)
    assert [order.in_core(name) for name in "abc"] == [True, True, False]
    changes = order.use("c", 4)  # last used at 3, after the core's oldest (a, at 1)
    assert changes.joined == ["c"] and changes.left == ["a"]
    # Pushed out to the front of the evicted-first part.
    assert [name for name, _ in order.items()] == ["a", "b", "c"]
    oldest = order.pop_oldest()
    assert oldest is not None and oldest[0] == "a"
    order.check()


def test_a_page_read_again_stays_out_when_the_core_is_fresher() -> None:
    order = EvictionOrder(1 * PAGE)
    order.write("a", PAGE, 1)
    order.write("b", PAGE, 2)
    order.use("a", 3)
    changes = order.use("b", 4)  # last used at 2, before the core's oldest (a, at 3)
    assert not changes.joined and not order.in_core("b")


def test_a_scan_that_finds_too_many_core_pages_pushes_the_oldest_out() -> None:
    order = EvictionOrder(2 * PAGE)
    for stamp, name in enumerate(["a", "b", "c", "d"], start=1):
        order.adopt(name, PAGE, stamp, core=name != "d")
    changes = order.trim()
    assert changes.left == ["a"] and not changes.joined
    assert [order.in_core(name) for name in "abcd"] == [False, True, True, False]
    order.check()


def test_a_lifted_pin_is_evicted_first() -> None:
    order = EvictionOrder(2 * PAGE)
    order.write("a", PAGE, 1)
    order.write("b", PAGE, 2)
    order.write("c", PAGE, 3)
    order.add_oldest("p", PAGE)
    assert next(iter(order.items()))[0] == "p"


def test_a_size_of_zero_is_lru() -> None:
    order = EvictionOrder(0)
    for stamp, name in enumerate("abc", start=1):
        order.write(name, PAGE, stamp)
    order.use("a", 4)
    assert [name for name, _ in order.items()] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="core_bytes"):
        EvictionOrder(-1)


@pytest.mark.parametrize("seed", range(5))
def test_random_use_keeps_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    order = EvictionOrder(rng.choice([0, 3, 7]) * PAGE)
    names = pages("p", 20)
    for stamp in range(1, 600):
        name = rng.choice(names)
        action = rng.random()
        if action < 0.35:
            order.write(name, PAGE * rng.choice([1, 2]), stamp)
        elif action < 0.6:
            order.use(name, stamp)
        elif action < 0.75:
            oldest = order.pop_oldest()
            if oldest is not None:
                order.remember(oldest[0], oldest[2])
        elif action < 0.85:
            order.pop(name, evicted=rng.random() < 0.5)
        elif action < 0.9:
            order.add_oldest(name, PAGE)
        elif action < 0.95:
            order.adopt(name, PAGE, stamp, core=rng.random() < 0.5)
            order.trim()
        elif name in order:
            order.refresh(name)
        order.check()
