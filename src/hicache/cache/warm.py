"""Warm: prefetch given prefixes from L3 into the host tier (L2), computing nothing.

A worker that is about to take traffic (or is told a conversation will come back)
reads what L3 holds of those prefixes into its host pool ahead of the requests, so
that they find it as an L2 hit. ``L3Warm`` runs on the scheduler thread in steps
(``step``), each short: it starts the prefetches that fit and settles the ones that
are done; the cache's own ``poll`` (every scheduler tick) moves them in between.
The caller bounds the whole by ceasing to step and calling ``stop``.

Invariants:

- a prefix is prefetched exactly as a request's is (``HierarchicalCache.prefetch``,
  ``prefetch_done``, ``finish_prefetch``): what lands joins the tree as host pages,
  nothing is loaded to the device and nothing is computed;
- the host pages this warm's prefetches hold or brought never exceed
  ``max_host_fraction`` of the host pool: items are taken in order, a prefix past
  the budget is cut to what is left ("clipped"), and once nothing is left the rest
  are clipped to nothing; an item waits (deferred, in order) while the L3 tier's
  own in-flight budget or a prefetch of the same first page leaves it no room;
- every item ends with one outcome (``WarmOutcome``), decided from what was asked,
  what L3 held and what landed (``settle_outcome``); ``stop`` settles what is in
  flight keeping what landed, so no prefetch outlives its warm.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.cache.hierarchical_cache import HierarchicalCache
    from hicache.cache.l3 import PrefetchHandle


class WarmOutcome(str, Enum):
    WARMED = "warmed"  # what L3 holds of the prefix (within the budget) is on the host
    CLIPPED = "clipped"  # cut short: the host fraction, host room or the deadline
    NOT_IN_L3 = "not_in_l3"  # L3 holds nothing of what the local tiers lack
    REJECTED = "rejected"  # not prefetched at all (too short, or the cache refused)


@dataclass
class WarmResult:
    index: int
    outcome: WarmOutcome
    tokens: int = 0  # tokens this warm brought from L3 into the host tier
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "outcome": self.outcome.value, "tokens": self.tokens,
                "reason": self.reason}


def settle_outcome(
    *, missing_tokens: int, asked_tokens: int, found_tokens: int, inserted_tokens: int,
    timed_out: bool,
) -> tuple[WarmOutcome, str]:
    """The outcome of a settled prefetch of ``asked_tokens`` of the ``missing_tokens``
    the local tiers lacked: L3 held ``found_tokens`` of them (-1: its lookup had not
    answered), ``inserted_tokens`` landed in the host tier."""
    if found_tokens < 0:
        return WarmOutcome.CLIPPED, "timed out before L3 answered the lookup"
    if found_tokens == 0:
        return WarmOutcome.NOT_IN_L3, f"L3 holds none of the {asked_tokens} tokens asked for"
    if inserted_tokens < found_tokens:
        why = "timed out" if timed_out else "no host room for L3 prefetches"
        return WarmOutcome.CLIPPED, (
            f"{inserted_tokens} of the {found_tokens} tokens L3 holds landed ({why})"
        )
    if asked_tokens < missing_tokens:
        return WarmOutcome.CLIPPED, (
            f"the host fraction allowed {asked_tokens} of the {missing_tokens} tokens missing"
        )
    if found_tokens < asked_tokens:
        return WarmOutcome.WARMED, (
            f"L3 holds only the first {found_tokens} of the {asked_tokens} tokens missing"
        )
    return WarmOutcome.WARMED, ""


@dataclass
class _Item:
    index: int
    tokens: list[int]
    extra_key: str | None = None
    missing_tokens: int = 0
    asked_tokens: int = 0
    handle: PrefetchHandle | None = None


class L3Warm:
    """One warm of ``items`` (token-id lists), within ``max_host_fraction`` of the host pool."""

    def __init__(
        self, cache: HierarchicalCache, items: list[list[int]], max_host_fraction: float,
        extra_keys: list[str | None] | None = None,
    ) -> None:
        """``extra_keys``: each item's cache salt (None: unsalted)."""
        self._cache = cache
        host_pages = cache.host_pool.num_pages if cache.host_pool is not None else 0
        self.budget_pages = int(host_pages * max_host_fraction)
        salts = extra_keys if extra_keys is not None else [None] * len(items)
        self._pending: deque[_Item] = deque(
            _Item(i, list(t), salt) for i, (t, salt) in enumerate(zip(items, salts, strict=True))
        )
        self._running: list[_Item] = []
        self._held_pages = 0  # host pages this warm's settled prefetches brought
        self._results: dict[int, WarmResult] = {}
        self._num_items = len(items)

    @property
    def done(self) -> bool:
        return len(self._results) == self._num_items

    def step(self) -> dict[str, Any]:
        """Settle the done prefetches, start those that fit; report."""
        cache = self._cache
        for item in list(self._running):
            assert item.handle is not None
            if cache.prefetch_done(item.handle):
                self._settle(item, timed_out=False)
        while self._pending and self._start_next():
            pass
        return self.progress()

    def stop(self) -> dict[str, Any]:
        """The caller's deadline: settle what is in flight keeping what landed; the items
        not started are clipped to nothing."""
        for item in list(self._running):
            self._settle(item, timed_out=True)
        while self._pending:
            item = self._pending.popleft()
            self._results[item.index] = WarmResult(
                item.index, WarmOutcome.CLIPPED, 0, "timed out before its prefetch started"
            )
        return self.progress()

    def progress(self) -> dict[str, Any]:
        results = [self._results[i].as_dict() for i in sorted(self._results)]
        return {"done": self.done, "budget_pages": self.budget_pages, "results": results}

    # ------------------------------------------------------------ internals
    def _start_next(self) -> bool:
        """Start (or end) the first pending item; False when it must wait."""
        cache = self._cache
        item = self._pending[0]
        page = cache.page_size
        whole = len(item.tokens) // page
        if whole == 0:
            return self._end(item, WarmOutcome.REJECTED, f"shorter than one page ({page} tokens)")
        if cache.storage is None:
            return self._end(item, WarmOutcome.REJECTED, "no L3 storage backend is attached")
        peek = cache.peek(item.tokens, item.extra_key)
        missing = whole - peek.num_device_pages - peek.num_host_pages
        if missing <= 0:
            return self._end(item, WarmOutcome.WARMED, "already cached")
        if any(self._same_start(item, other) for other in self._running):
            return False  # the same pages are on their way: see what is left after them
        left = self.budget_pages - self._in_use_pages()
        if left <= 0:
            if self._running:
                return False  # a prefetch may find less than it asked and leave room
            return self._end(item, WarmOutcome.CLIPPED, "the host fraction is used up")
        asked = min(missing, left)
        storage = cache.storage
        room = storage.prefetch_budget_pages - storage.num_in_flight_prefetch_pages
        if self._running and (asked > room or not cache.prefetch_slot_free):
            return False  # the L3 tier's in-flight budget: wait for ours to land
        item.missing_tokens, item.asked_tokens = missing * page, asked * page
        end = (whole - missing + asked) * page
        handle = cache.prefetch(item.tokens[:end], item.extra_key)
        if handle is None:
            threshold = storage.config.prefetch_threshold
            if item.asked_tokens < threshold:
                outcome = WarmOutcome.CLIPPED if asked < missing else WarmOutcome.REJECTED
                return self._end(item, outcome, (
                    f"{item.asked_tokens} tokens to fetch, under the L3 prefetch threshold "
                    f"({threshold})"
                ))
            return self._end(item, WarmOutcome.REJECTED, "the cache could not start a prefetch")
        item.handle = handle
        self._running.append(self._pending.popleft())
        return True

    def _end(self, item: _Item, outcome: WarmOutcome, reason: str) -> bool:
        self._pending.popleft()
        self._results[item.index] = WarmResult(item.index, outcome, 0, reason)
        return True

    def _settle(self, item: _Item, timed_out: bool) -> None:
        assert item.handle is not None
        found = item.handle.num_found_tokens
        inserted = self._cache.finish_prefetch(item.handle)
        item.handle = None
        self._running.remove(item)
        self._held_pages += inserted // self._cache.page_size
        outcome, reason = settle_outcome(
            missing_tokens=item.missing_tokens, asked_tokens=item.asked_tokens,
            found_tokens=found, inserted_tokens=inserted, timed_out=timed_out,
        )
        self._results[item.index] = WarmResult(item.index, outcome, inserted, reason)

    def _in_use_pages(self) -> int:
        running = sum(
            self._cache.prefetch_pages(item.handle)
            for item in self._running if item.handle is not None
        )
        return self._held_pages + running

    def _same_start(self, item: _Item, other: _Item) -> bool:
        page = self._cache.page_size
        return item.tokens[:page] == other.tokens[:page] and item.extra_key == other.extra_key
