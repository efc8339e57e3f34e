"""The order in which the file store evicts its pages under its cap: loop-resistant.

Least-recently-used eviction fails a cyclic reuse larger than the store: the page it
evicts is the one the loop asks for next, so no page ever hits (a router's
conversations taking turns over a shared L3 smaller than their working set do exactly
this). As in LIRS, and as the host tier does (``radix.tree``), a core set of up to
``core_bytes`` is evicted only after every page outside it; each part is evicted least
recently used first.

A page joins the core set:
- when it is written or read and the set has room for it;
- when it is read again and its previous use (write or read) is more recent than the
  core set's least recently used page: it came back sooner than the core's oldest page
  did, so the workload has moved;
- when it is written again after being evicted and its last use before the eviction
  (kept in a bounded history, like LIRS's entries for blocks no longer cached) is more
  recent than the core set's least recently used page.
A page joining a full set pushes the core set's least recently used pages out of it, to
the front of the evicted-first part (their last use is older than the joiner's).

Under a loop, the pages that filled the set first stay and hit every round, and the
rest churn through the part outside it. With ``core_bytes`` 0 it is plain LRU.

Not thread-safe: the file backend guards it with its lock. Uses are stamped with the
nanosecond times the backend gives its files, so an order rebuilt from a directory scan
(``adopt``, modification times) compares with the stamps of later uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

# Evicted pages whose last use is kept, at least (more with a larger store: twice the
# pages it holds, so a loop up to about three times the store's size is recognized).
MIN_HISTORY = 1024


@dataclass
class Changes:
    """Pages whose core membership a call changed (for the backend to record on disk)."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


class EvictionOrder:
    """See the module docstring. Maps page name -> file bytes."""

    def __init__(self, core_bytes: int) -> None:
        if core_bytes < 0:
            raise ValueError(f"core_bytes must be >= 0, got {core_bytes}")
        self.core_bytes = core_bytes
        # Least recently used first, outside the core set and in it.
        self._outside: OrderedDict[str, int] = OrderedDict()
        self._core: OrderedDict[str, int] = OrderedDict()
        self._used: dict[str, int] = {}  # name -> last use stamp (ns)
        self._core_total = 0
        self._total = 0
        self._history: OrderedDict[str, int] = OrderedDict()  # evicted name -> last use

    # ------------------------------------------------------------ reading
    def __contains__(self, name: str) -> bool:
        return name in self._used

    def __len__(self) -> int:
        return len(self._used)

    def __iter__(self) -> Iterator[str]:
        return iter(self._used)

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def core_total(self) -> int:
        """Bytes of the pages in the core set."""
        return self._core_total

    def in_core(self, name: str) -> bool:
        return name in self._core

    def items(self) -> Iterator[tuple[str, int]]:
        """(name, bytes) in eviction order: outside the core set, then in it, each least
        recently used first (a copy: safe to change the order while iterating)."""
        return iter([*self._outside.items(), *self._core.items()])

    # ------------------------------------------------------------ changing
    def write(self, name: str, size: int, stamp: int) -> Changes:
        """``name`` was written (a use): the most recently used page; it joins the core
        set by the module docstring's rules (its history counts, when it was evicted)."""
        previous = self._history.pop(name, None)
        self.pop(name)
        return self._insert(name, size, stamp, previous)

    def use(self, name: str, stamp: int) -> Changes:
        """``name`` was read (a use): the most recently used page; a page outside the
        core set may join it. Unknown names are ignored."""
        previous = self._used.get(name)
        if previous is None:
            return Changes()
        if name in self._core:
            self._core.move_to_end(name)
            self._used[name] = stamp
            return Changes()
        size = self._outside.pop(name)
        self._total -= size
        del self._used[name]
        return self._insert(name, size, stamp, previous)

    def adopt(self, name: str, size: int, stamp: int, core: bool) -> None:
        """Record a page found on disk (a scan adopts pages in their LRU order, oldest
        first), in the core set or not as its file says; ``trim`` after the scan."""
        self.pop(name)
        self._history.pop(name, None)
        (self._core if core else self._outside)[name] = size
        self._core_total += size if core else 0
        self._total += size
        self._used[name] = stamp

    def trim(self) -> Changes:
        """Push the core set's least recently used pages out until it fits (instances
        sharing a directory may each have filled it)."""
        return self._shrink(Changes())

    def refresh(self, name: str) -> None:
        """Make ``name`` the most recently used of its part, changing nothing else (pages
        of one batch written side by side: their recency is the batch's order)."""
        (self._core if name in self._core else self._outside).move_to_end(name)

    def inherit_history(self, other: EvictionOrder) -> None:
        """Take ``other``'s history of evicted pages (an order rebuilt by a scan), but of
        the pages stored again."""
        for name, stamp in other._history.items():
            if name not in self._used:
                self._history[name] = stamp

    def add_oldest(self, name: str, size: int) -> None:
        """Record ``name`` outside the core set as the first to evict (a page whose pin
        was lifted)."""
        self.pop(name)
        self._history.pop(name, None)
        self._outside[name] = size
        self._outside.move_to_end(name, last=False)
        self._total += size
        self._used[name] = 0

    def pop(self, name: str, evicted: bool = False) -> int | None:
        """Forget ``name``; its bytes, or None when it was not recorded. ``evicted``: it
        was evicted to make room, so its last use is kept in the history."""
        used = self._used.pop(name, None)
        if used is None:
            return None
        if name in self._core:
            size = self._core.pop(name)
            self._core_total -= size
        else:
            size = self._outside.pop(name)
        self._total -= size
        if evicted:
            self._remember(name, used)
        return size

    def pop_oldest(self) -> tuple[str, int, int] | None:
        """The next page to evict, forgotten: (name, bytes, last use), not yet in the
        history (the caller says whether it was evicted, ``remember``, or set aside);
        None when empty."""
        source = self._outside or self._core
        if not source:
            return None
        name = next(iter(source))
        used = self._used[name]
        size = self.pop(name)
        assert size is not None
        return name, size, used

    def remember(self, name: str, stamp: int) -> None:
        """``name`` was evicted, last used at ``stamp``."""
        self._remember(name, stamp)

    def last_use(self, name: str) -> int | None:
        return self._used.get(name)

    def clear(self) -> None:
        self._outside.clear()
        self._core.clear()
        self._used.clear()
        self._history.clear()
        self._core_total = self._total = 0

    def check(self) -> None:
        """Assert the invariants (tests)."""
        assert set(self._outside).isdisjoint(self._core), "a page both in and out of the core"
        assert set(self._used) == set(self._outside) | set(self._core), "stamps drifted"
        assert self._core_total == sum(self._core.values()), "core bytes drifted"
        assert self._total == self._core_total + sum(self._outside.values()), "bytes drifted"
        assert self._core_total <= self.core_bytes, "core over its size"
        assert set(self._history).isdisjoint(self._used), "a stored page in the history"

    # ------------------------------------------------------------ internals
    def _insert(self, name: str, size: int, stamp: int, previous: int | None) -> Changes:
        changes = Changes()
        self._used[name] = stamp
        self._total += size
        if self._joins(size, previous):
            self._core[name] = size
            self._core_total += size
            changes.joined.append(name)
            return self._shrink(changes, keep=name)
        self._outside[name] = size
        return changes

    def _joins(self, size: int, previous: int | None) -> bool:
        if size > self.core_bytes:
            return False
        if self._core_total + size <= self.core_bytes:
            return True
        if previous is None or not self._core:
            return False
        return previous > self._used[next(iter(self._core))]

    def _shrink(self, changes: Changes, keep: str | None = None) -> Changes:
        """Push the oldest core pages (never ``keep``) out, to the front of the evicted-
        first part, while the set is over its size."""
        pushed: list[tuple[str, int]] = []
        while self._core_total > self.core_bytes:
            name = next(iter(self._core))
            if name == keep:
                break
            size = self._core.pop(name)
            self._core_total -= size
            pushed.append((name, size))
            if name in changes.joined:
                changes.joined.remove(name)
            else:
                changes.left.append(name)
        # Oldest first at the front: the first pushed is the least recently used.
        for name, size in reversed(pushed):
            self._outside[name] = size
            self._outside.move_to_end(name, last=False)
        return changes

    def _remember(self, name: str, stamp: int) -> None:
        self._history[name] = stamp
        self._history.move_to_end(name)
        limit = max(MIN_HISTORY, 2 * len(self._used))
        while len(self._history) > limit:
            self._history.popitem(last=False)
