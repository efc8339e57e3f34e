"""HintBook outcomes on a real cache (L1 + L2): each kind accepted, clipped, deferred or
rejected as its contract says; pin budgets per tenant and in total; pin floods and absurd
TTLs rejected with bounded memory; pinned and retained prefixes survive host pressure
and still give the cold KV; expiries on the cache's clock; L3 pins through a controller
that can pin (a stand-in); a flush forgets every hint."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hicache.cache.hints as hints_module
from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig
from hicache.engine.api import Hint, HintKind, HintOutcome, HintOutcomeKind
from hicache.memory.geometry import KVGeometry
from hicache.radix.node import TreeNode
from tests.kv_oracle import conversation, serve

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 2
DEVICE_PAGES = 16
HOST_PAGES = 40  # pins: 20 pages in all, 10 per tenant

ACCEPTED, CLIPPED = HintOutcomeKind.ACCEPTED, HintOutcomeKind.CLIPPED
DEFERRED, REJECTED = HintOutcomeKind.DEFERRED, HintOutcomeKind.REJECTED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cache() -> Iterator[HierarchicalCache]:
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
        load_back_threshold_tokens=1, hint_max_ttl_s=3600.0, retain_ttl_s=60.0,
        # Hints against least-recently-used eviction alone: with a core set (its own
        # tests, test_tree_core.py) the pressure would not evict the unpinned prefixes.
        host_core_fraction=0.0,
    )
    built = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    built.clock = Clock()
    try:
        yield built
    finally:
        built.storage = None  # a stand-in store is not closed
        built.close()


def clock(cache: HierarchicalCache) -> Clock:
    assert isinstance(cache.clock, Clock)
    return cache.clock


def cached(cache: HierarchicalCache, tokens: list[int]) -> int:
    """Tokens of ``tokens`` in L1 or L2."""
    peek = cache.peek(tokens)
    return (peek.num_device_pages + peek.num_host_pages) * PAGE


def one(cache: HierarchicalCache, hint: Hint) -> HintOutcome:
    [outcome] = cache.hints.apply([hint])
    return outcome


def pin(tokens: list[int], **kwargs: Any) -> Hint:
    return Hint(HintKind.PIN, tuple(tokens), **kwargs)


def warm(cache: HierarchicalCache, *prompts: list[int]) -> None:
    for tokens in prompts:
        serve(cache, tokens)
    cache.poll(wait=True)


def pressure(cache: HierarchicalCache, rounds: int = 12, seed: int = 100) -> None:
    """Enough other prompts to push every unhinted prefix out of both tiers."""
    for i in range(rounds):
        serve(cache, conversation(16, seed=seed + i))
        cache.poll(wait=True)


# ------------------------------------------------------------------- pin
def test_pinned_prefix_survives_host_pressure_and_gives_the_cold_kv(
    cache: HierarchicalCache,
) -> None:
    kept, lost = conversation(8, seed=1), conversation(8, seed=2)
    warm(cache, kept, lost)
    outcome = one(cache, pin(kept))
    assert (outcome.outcome, outcome.tokens, outcome.reason) == (ACCEPTED, 8, "")
    assert cache.hints.status()["pinned_pages"] == 4
    pressure(cache)
    assert cached(cache, lost) == 0
    assert cached(cache, kept) == 8
    assert serve(cache, kept) == 8  # served from L2; serve() checks the KV against cold
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_pin_copies_device_only_pages_to_the_host_under_any_policy(policy: str) -> None:
    config = CacheConfig(page_size=PAGE, enable_hierarchical_cache=True, io_backend="direct",
                         load_back_threshold_tokens=1, write_policy=policy)
    cache = HierarchicalCache(config, GEOMETRY, DEVICE_PAGES, host_num_pages=HOST_PAGES)
    try:
        kept = conversation(8, seed=1)
        warm(cache, kept)
        assert cache.tree.num_host_pages == 0  # not copied yet under these policies
        assert one(cache, pin(kept)).outcome is ACCEPTED
        cache.poll(wait=True)
        assert cache.tree.walk_prefix(kept)[-1].host_pages is not None
        pressure(cache)
        assert cached(cache, kept) == 8
        assert serve(cache, kept) == 8
        cache.check_integrity()
    finally:
        cache.close()


def test_tenant_budget_clips_then_rejects_and_other_tenants_still_pin(
    cache: HierarchicalCache,
) -> None:
    first, second, third = (conversation(24, seed=s) for s in (1, 2, 3))
    warm(cache, first)
    clipped = one(cache, pin(first, tenant="a"))  # 12 pages, the tenant may hold 10
    assert (clipped.outcome, clipped.tokens, clipped.clipped_tokens) == (CLIPPED, 20, 4)
    assert "pinned budget full" in clipped.reason
    warm(cache, second)
    full = one(cache, pin(second, tenant="a"))
    assert full.outcome is REJECTED and full.reason.startswith("pinned budget full")
    other = one(cache, pin(second, tenant="b"))
    assert (other.outcome, other.tokens) == (CLIPPED, 20)
    # All pins hold 20 pages, the whole budget: a third tenant gets nothing.
    warm(cache, third)
    assert one(cache, pin(third, tenant="c")).outcome is REJECTED
    status = cache.hints.status()
    assert status["pinned_pages"] == 20 == status["pin_budget_pages"]
    assert status["pinned_pages_by_tenant"] == {"a": 10, "b": 10}
    cache.check_integrity()


def test_pages_shared_by_two_pins_count_once_in_all(cache: HierarchicalCache) -> None:
    head = conversation(8, seed=1)
    warm(cache, head)
    assert one(cache, pin(head, tenant="a")).outcome is ACCEPTED
    assert one(cache, pin(head, tenant="b")).outcome is ACCEPTED
    status = cache.hints.status()
    assert status["pinned_pages"] == 4
    assert status["pinned_pages_by_tenant"] == {"a": 4, "b": 4}


def test_repin_refreshes_without_double_count_and_unpin_releases(
    cache: HierarchicalCache,
) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    one(cache, pin(tokens, ttl_s=10.0))
    again = one(cache, pin(tokens, ttl_s=100.0))
    assert again.outcome is ACCEPTED and "refreshed" in again.reason
    assert cache.hints.status()["records"] == 1
    assert cache.hints.status()["pinned_pages"] == 4
    clock(cache).now += 50.0  # past the first TTL, within the refreshed one
    cache.poll()
    assert cache.hints.status()["pinned_pages"] == 4
    released = one(cache, Hint(HintKind.UNPIN, tuple(tokens)))
    assert (released.outcome, released.tokens) == (ACCEPTED, 8)
    assert cache.hints.status()["pinned_pages"] == 0
    assert one(cache, Hint(HintKind.UNPIN, tuple(tokens))).reason == "not pinned"
    cache.check_integrity()


def test_pin_expires_on_the_cache_clock(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    one(cache, pin(tokens, ttl_s=30.0))
    clock(cache).now += 29.0
    cache.poll()
    assert cache.hints.status()["records"] == 1
    clock(cache).now += 1.0
    cache.poll()
    assert cache.hints.status()["records"] == 0
    assert cache.tree.num_pinned_pages == 0
    cache.check_integrity()


@pytest.mark.parametrize("ttl", [0.0, -5.0, float("nan"), float("inf"), True])
def test_absurd_ttls_are_rejected(cache: HierarchicalCache, ttl: float) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    for kind in (HintKind.PIN, HintKind.RETAIN):
        outcome = one(cache, Hint(kind, tuple(tokens), ttl_s=ttl))
        assert outcome.outcome is REJECTED and "ttl_s" in outcome.reason
    assert cache.hints.status()["records"] == 0 and not cache.tree.has_retains


def test_ttl_above_the_maximum_is_clipped_to_it(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    outcome = one(cache, pin(tokens, ttl_s=1e12))
    assert outcome.outcome is ACCEPTED and "clipped to the maximum of 3600" in outcome.reason
    clock(cache).now += 3600.0
    cache.poll()
    assert cache.hints.status()["records"] == 0


def test_unknown_prefix_and_bad_items_are_rejected(cache: HierarchicalCache) -> None:
    results = cache.hints.apply([
        pin(conversation(8, seed=9)),
        Hint(HintKind.RETAIN, tuple(conversation(8, seed=9))),
        Hint(HintKind.DEMOTE, tuple(conversation(8, seed=9))),
        Hint(HintKind.PREFETCH, tuple(conversation(8, seed=9))),
        pin([1]),
        pin([1, 2], tier="disk"),
        pin([1, 2], tenant=""),
        pin([1, -2]),
        Hint(HintKind.PIN),
    ])
    assert [r.outcome for r in results] == [REJECTED] * 9
    assert [r.index for r in results] == list(range(9))
    reasons = [r.reason for r in results]
    assert reasons[0].startswith("unknown prefix") and reasons[1].startswith("unknown prefix")
    assert reasons[2].startswith("unknown prefix")
    assert reasons[3] == "no L3 storage backend is attached"
    assert "shorter than one page" in reasons[4]
    assert "unknown tier" in reasons[5] and "tenant" in reasons[6]
    assert "non-negative" in reasons[7] and "no prefix" in reasons[8]
    assert cache.hints.status()["outcomes"]["pin/rejected"] == 6
    cache.check_integrity()


def test_pin_floods_are_bounded(cache: HierarchicalCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hints_module, "MAX_RECORDS_PER_TENANT", 3)
    monkeypatch.setattr(hints_module, "MAX_RECORDS", 5)
    tokens = conversation(16, seed=1)
    warm(cache, tokens)
    prefixes = [tokens[: 2 * (i + 1)] for i in range(8)]  # 8 distinct one-page-longer prefixes
    outcomes = cache.hints.apply([pin(p, tenant="a") for p in prefixes])
    assert [o.outcome for o in outcomes[:3]] == [ACCEPTED] * 3
    assert all(o.outcome is REJECTED and "too many pins" in o.reason for o in outcomes[3:])
    outcomes = cache.hints.apply([pin(p, tenant="b") for p in prefixes[:3]])
    assert [o.outcome for o in outcomes] == [ACCEPTED, ACCEPTED, REJECTED]
    assert cache.hints.status()["records"] == 5
    cache.check_integrity()


# ---------------------------------------------------------------- retain
def test_retained_prefix_outlives_ordinary_ones_until_its_ttl(cache: HierarchicalCache) -> None:
    kept, lost = conversation(8, seed=1), conversation(8, seed=2)
    warm(cache, kept, lost)
    outcome = one(cache, Hint(HintKind.RETAIN, tuple(kept), ttl_s=100.0))
    assert (outcome.outcome, outcome.tokens) == (ACCEPTED, 8)
    pressure(cache)
    assert cached(cache, lost) == 0 and cached(cache, kept) == 8
    assert serve(cache, kept) == 8
    clock(cache).now += 100.0
    cache.poll()
    assert cache.hints.status()["retained_pages"] == 0
    pressure(cache, rounds=12, seed=300)
    assert cached(cache, kept) == 0  # ordinary again: evicted like the rest
    cache.check_integrity()


def test_retain_of_a_partly_cached_prefix_is_clipped(cache: HierarchicalCache) -> None:
    tokens = conversation(12, seed=1)
    warm(cache, tokens[:8])
    outcome = one(cache, Hint(HintKind.RETAIN, tuple(tokens)))
    assert (outcome.outcome, outcome.tokens, outcome.clipped_tokens) == (CLIPPED, 8, 4)
    assert "only 8 of the 12 tokens are cached" in outcome.reason
    assert cache.hints.status()["retained_pages"] == 4


# ---------------------------------------------------------------- demote
def test_demote_marks_only_the_conversations_own_nodes(cache: HierarchicalCache) -> None:
    head = conversation(8, seed=1)
    over, other = head + conversation(8, seed=2), head + conversation(8, seed=3)
    warm(cache, over, other)
    outcome = one(cache, Hint(HintKind.DEMOTE, tuple(over)))
    assert (outcome.outcome, outcome.tokens) == (ACCEPTED, 8)
    assert sorted(n.evict_class for n in cache.tree.iter_nodes()) == [-1, 0, 0]
    head_node = cache.tree.walk_prefix(head)[-1]
    assert head_node.evict_class == 0


def test_demote_leaves_pins_pinned_and_says_so(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    one(cache, pin(tokens))
    outcome = one(cache, Hint(HintKind.DEMOTE, tuple(tokens)))
    assert (outcome.outcome, outcome.clipped_tokens) == (CLIPPED, 8)
    assert "pinned" in outcome.reason
    pressure(cache)
    assert cached(cache, tokens) == 8


def test_a_demoted_prefix_is_evicted_before_older_ones(cache: HierarchicalCache) -> None:
    old, done = conversation(8, seed=1), conversation(8, seed=2)
    warm(cache, old, done)
    one(cache, Hint(HintKind.DEMOTE, tuple(done)))
    cache.free_device(cache.alloc_device(DEVICE_PAGES))  # both prefixes now in L2 only
    host = cache.host_pool
    assert host is not None
    host.allocator.free(cache.alloc_host(host.allocator.num_free_pages + 4))  # evicts 4 pages
    assert cached(cache, done) == 0 and cached(cache, old) == 8
    cache.check_integrity()


# ---------------------------------------------------------- own tokens
def test_hints_without_input_ids_are_about_the_given_own_tokens(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    outcomes = cache.hints.apply(
        [Hint(HintKind.RETAIN), Hint(HintKind.PIN, tenant="t")], own_tokens=[*tokens, 5]
    )
    assert [(o.outcome, o.tokens) for o in outcomes] == [(ACCEPTED, 8), (ACCEPTED, 8)]


# -------------------------------------------------------------- L3 pins
@dataclass
class PinningController:
    supports_pins: bool = True
    pins: list[tuple[list[bytes], float]] = field(default_factory=list)
    unpins: list[list[bytes]] = field(default_factory=list)

    def pin(self, keys: list[bytes], until_unix_s: float) -> None:
        self.pins.append((list(keys), until_unix_s))

    def unpin(self, keys: list[bytes]) -> None:
        self.unpins.append(list(keys))

    def wait_idle(self) -> bool:
        return True


@dataclass
class StandInStorage:
    """What the hint book and the cache's poll use of an L3 tier."""

    controller: PinningController = field(default_factory=PinningController)
    backend: Any = field(default_factory=lambda: SimpleNamespace(name="stand-in"))
    written: list[TreeNode] = field(default_factory=list)

    def backup(self, node: TreeNode) -> None:
        self.written.append(node)
        node.l3_stored = True

    def backing_up(self, node: TreeNode) -> bool:
        return False

    def poll(self) -> None:
        pass

    def retain_stalled_host_pages(self, pages: Any) -> Any:
        return pages


def test_l3_pin_writes_what_l3_lacks_then_pins_and_unpins(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    storage = StandInStorage()
    cache.storage = storage  # type: ignore[assignment]
    outcome = one(cache, pin(tokens, tier="l3", ttl_s=60.0))
    assert (outcome.outcome, outcome.tokens) == (ACCEPTED, 8)
    assert storage.written  # the host pages went to L3 first
    [(keys, until)] = storage.controller.pins
    assert keys == cache.tree.page_keys(cache.tree.walk_prefix(tokens)[-1])
    assert until > 0
    assert cache.hints.status()["pinned_pages"] == 0  # not in the host budget
    clock(cache).now += 60.0
    cache.poll()
    assert storage.controller.unpins == [keys]
    assert cache.hints.status()["records"] == 0


def test_l3_pin_needs_a_backend_that_can_pin(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    assert one(cache, pin(tokens, tier="l3")).reason == "no L3 storage backend is attached"
    cache.storage = StandInStorage(PinningController(supports_pins=False))  # type: ignore[assignment]
    outcome = one(cache, pin(tokens, tier="l3"))
    assert outcome.outcome is REJECTED and "'stand-in' cannot pin" in outcome.reason


def test_l3_pin_of_device_only_pages_waits_for_their_host_copy(
    cache: HierarchicalCache,
) -> None:
    storage = StandInStorage()
    cache.storage = storage  # type: ignore[assignment]
    tokens = conversation(8, seed=1)
    hit = cache.acquire(tokens)
    pages = cache.alloc_device(4)
    cache.insert(tokens, pages)  # write-through issues the copy; it has not landed
    cache.release(hit)
    # The copy is acknowledged at the next poll only: until then it is in flight.
    assert any(cache.copying_to_host(n) for n in cache.tree.walk_prefix(tokens))
    outcome = one(cache, pin(tokens, tier="l3"))
    assert outcome.outcome is DEFERRED and not storage.controller.pins
    cache.poll(wait=True)
    cache.poll()
    assert len(storage.controller.pins) == 1
    unpinned = one(cache, Hint(HintKind.UNPIN, tuple(tokens)))
    assert unpinned.outcome is ACCEPTED and len(storage.controller.unpins) == 1


# ----------------------------------------------------------------- flush
def test_flush_forgets_every_hint_on_l1_and_l2(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    cache.hints.apply([pin(tokens), Hint(HintKind.RETAIN, tuple(tokens))])
    cache.flush()
    status = cache.hints.status()
    assert (status["records"], status["pinned_pages"], status["retained_pages"]) == (0, 0, 0)
    assert status["pinned_pages_by_tenant"] == {}
    cache.poll()
    cache.check_integrity()
    warm(cache, tokens)  # cached again: pinned anew, within the whole budget
    assert one(cache, pin(tokens)).outcome is ACCEPTED


def test_l3_pins_outlive_a_flush(cache: HierarchicalCache) -> None:
    tokens = conversation(8, seed=1)
    warm(cache, tokens)
    storage = StandInStorage()
    cache.storage = storage  # type: ignore[assignment]
    one(cache, pin(tokens, tier="l3"))
    cache.flush()
    assert cache.hints.status()["l3_pins"] == 1 and not storage.controller.unpins
    assert one(cache, Hint(HintKind.UNPIN, tuple(tokens))).outcome is ACCEPTED
    assert len(storage.controller.unpins) == 1
