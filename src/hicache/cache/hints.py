"""HintBook: what hints do to the cache: pin, unpin, retain, prefetch, demote.

A client that knows which prefixes will come back (an agent framework, a router) says
so; each hint answers with one ``HintOutcome``. The book is owned by the
``HierarchicalCache`` and runs on the scheduler thread only: ``apply`` from a cache
operation or a finishing request, ``poll`` from the cache's own poll every tick.

- pin (tier host): the prefix's cached pages (device pages first get their host copy,
  as write-through makes them) are pinned in the tree (``pin_ref``): their host copy
  is never evicted. Budgets: all pins together hold at most ``pin_max_fraction`` of the
  host pool (pages counted once however many pins hold them), each tenant at most
  ``pin_tenant_fraction`` (each of its pins charged its full length: an overlap of two
  of its own pins counts twice, the conservative side); a prefix past a budget is
  clipped to what fits. A prefix not cached here is prefetched from L3 and pinned when
  it lands (deferred). Re-pinning a prefix refreshes its TTL.
- pin (tier l3): the L3 store keeps the prefix's pages (``StorageController.pin``);
  the pages L3 lacks are written first, in the order the write thread keeps.
- retain: the prefix's nodes are evicted after every ordinary node until the TTL.
- prefetch: what L3 holds of the prefix comes into the host tier, in the background
  (``cache/warm.py``), within ``--warm-host-fraction`` of the host pool per call.
- demote: the prefix's own nodes (walking up from its end while a node has no other
  child) are evicted before every ordinary node; pinned pages stay pinned.

Invariants:

- memory is bounded: at most ``MAX_RECORDS`` pins (``MAX_RECORDS_PER_TENANT`` per
  tenant) and ``MAX_PREFETCHES`` background prefetches; past them a hint is rejected;
- every TTL is finite and at most ``hint_max_ttl_s``; expiries are found through
  heaps (the tree's retain heap, the book's pin heap): ``poll`` costs O(1) when
  nothing is due;
- deadlines read the cache's clock, which under tensor parallelism is rank 0's tick
  clock, so every rank expires the same hints at the same tick; only the wall-clock
  deadline handed to an L3 store reads this process's clock;
- a hint that is rejected changes nothing.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from hicache.cache.warm import L3Warm
from hicache.config import WritePolicy
from hicache.engine.api import Hint, HintKind, HintOutcome, HintOutcomeKind
from hicache.radix.keys import chain_page_keys, pack_tokens, unpack_tokens
from hicache.radix.node import TreeNode
from hicache.tenancy.names import within_tenant

if TYPE_CHECKING:
    from hicache.cache.hierarchical_cache import HierarchicalCache

logger = logging.getLogger(__name__)

MAX_RECORDS = 65_536
MAX_RECORDS_PER_TENANT = 4_096
MAX_PREFETCHES = 64  # background L3 reads (prefetch hints and deferred pins) at once
MAX_TENANT_CHARS = 128
TIERS = ("host", "l3")

_ACCEPTED, _CLIPPED = HintOutcomeKind.ACCEPTED, HintOutcomeKind.CLIPPED
_DEFERRED, _REJECTED = HintOutcomeKind.DEFERRED, HintOutcomeKind.REJECTED

# (tenant, tier, extra_key, the prefix's whole pages as packed tokens)
_Key = tuple[str, str, str | None, bytes]


class _PinningController(Protocol):
    """What an L3 store controller that can pin offers (``storage/controller.py``)."""

    supports_pins: bool

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> None: ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...


@dataclass
class _Pin:
    key: _Key
    until: float  # on the cache's clock
    seq: int  # the expiry entry that stands for this record
    pages: int = 0  # host tier: pages charged to the tenant
    node: TreeNode | None = None  # host tier: the end of the pinned path
    l3_keys: list[bytes] = field(default_factory=list)  # L3 tier
    # L3 tier: host copies in flight; the pin is sent once they land (``poll``).
    waiting: list[TreeNode] = field(default_factory=list)

    @property
    def tenant(self) -> str:
        return self.key[0]


@dataclass
class _Background:
    """One L3 warm started by hints, and the pins waiting for what it brings."""

    warm: L3Warm
    # Per warm item: the pin to apply once it lands, or None.
    pins: list[_Deferred | None]


@dataclass(frozen=True)
class _Deferred:
    """A pin waiting for its prefix to land from L3."""

    hint: Hint
    extra_key: str | None
    data: bytes
    until: float


# A background read: (tenant, extra_key, prefix, the deadline of a pin waiting for it).
_Item = tuple[str, str | None, bytes, float | None]


class HintBook:
    def __init__(self, cache: HierarchicalCache) -> None:
        self._cache = cache
        config = cache.config
        self.max_ttl_s = config.hint_max_ttl_s
        self.retain_ttl_s = config.retain_ttl_s
        host_pages = cache.host_pool.num_pages if cache.host_pool is not None else 0
        self.pin_budget_pages = int(host_pages * config.pin_max_fraction)
        self.tenant_pin_budget_pages = int(host_pages * config.pin_tenant_fraction)
        self.prefetch_host_fraction = config.warm_host_fraction
        self.outcomes: Counter[str] = Counter()
        self._pins: dict[_Key, _Pin] = {}
        self._expiry: list[tuple[float, int, _Key]] = []
        self._seq = 0
        self._tenant_pages: Counter[str] = Counter()
        self._tenant_records: Counter[str] = Counter()
        self._background: list[_Background] = []
        self._l3_waiting: list[_Pin] = []

    # ------------------------------------------------------------ applying
    def apply(
        self, hints: Sequence[Hint], own_tokens: Sequence[int] | None = None,
        own_extra_key: str | None = None,
    ) -> list[HintOutcome]:
        """One outcome per hint, in order. A hint without ``input_ids`` is about
        ``own_tokens`` (a finishing request's prompt + output) under ``own_extra_key``."""
        now = self._cache.clock()
        results: list[HintOutcome] = []
        prefetches: list[_Item] = []
        for index, hint in enumerate(hints):
            try:
                outcome = self._apply_one(index, hint, own_tokens, own_extra_key, now,
                                          prefetches)
            except Exception as error:  # one hint's fault must not fail the others
                logger.exception("hint %d (%s) failed", index, getattr(hint, "kind", "?"))
                outcome = HintOutcome(index, HintKind(hint.kind), _REJECTED,
                                      reason=f"internal error: {type(error).__name__}: {error}")
            results.append(outcome)
        if prefetches:
            self._start_background(prefetches, [])
        for outcome in results:
            self.outcomes[f"{outcome.kind.value}/{outcome.outcome.value}"] += 1
        return results

    def _apply_one(
        self, index: int, hint: Hint, own_tokens: Sequence[int] | None,
        own_extra_key: str | None, now: float, prefetches: list[_Item],
    ) -> HintOutcome:
        try:
            kind = HintKind(hint.kind)
        except ValueError:
            return HintOutcome(index, HintKind.PIN, _REJECTED,
                               reason=f"unknown hint kind {hint.kind!r}")

        def reject(reason: str) -> HintOutcome:
            return HintOutcome(index, kind, _REJECTED, reason=reason)

        ids = hint.input_ids
        extra_key = hint.extra_key
        if ids is None:
            if own_tokens is None:
                return reject("no prefix: give input_ids")
            ids, extra_key = tuple(own_tokens), own_extra_key
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            return reject("input_ids must be non-negative integers")
        if not isinstance(hint.tenant, str) or not 0 < len(hint.tenant) <= MAX_TENANT_CHARS:
            return reject(f"tenant must be a name of 1 to {MAX_TENANT_CHARS} characters")
        page = self._cache.page_size
        whole = len(ids) // page
        if whole == 0:
            return reject(f"shorter than one page ({page} tokens)")
        data = pack_tokens(list(ids[: whole * page]))
        if kind is HintKind.PIN:
            if hint.tier not in TIERS:
                return reject(f"unknown tier {hint.tier!r}: choose one of {', '.join(TIERS)}")
            ttl, note = self._ttl(hint.ttl_s, self.max_ttl_s)
            if ttl is None:
                return reject(note)
            if hint.tier == "l3":
                return self._pin_l3(index, hint, extra_key, data, now + ttl, note)
            return self._pin_host(index, hint, extra_key, data, now + ttl, note, defer=True)
        if kind is HintKind.UNPIN:
            return self._unpin(index, hint.tenant, extra_key, data)
        if kind is HintKind.RETAIN:
            ttl, note = self._ttl(hint.ttl_s, self.retain_ttl_s)
            if ttl is None:
                return reject(note)
            return self._retain(index, extra_key, data, now + ttl, note)
        if kind is HintKind.PREFETCH:
            return self._prefetch(index, hint.tenant, extra_key, data, prefetches)
        return self._demote(index, extra_key, data)

    def _ttl(self, ttl_s: float | None, default: float) -> tuple[float | None, str]:
        """(the TTL to use, a note); (None, why) for one that is not usable."""
        if ttl_s is None:
            return min(default, self.max_ttl_s), ""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not (
            math.isfinite(ttl_s) and ttl_s > 0
        ):
            return None, f"ttl_s must be a positive, finite number of seconds, got {ttl_s!r}"
        if ttl_s > self.max_ttl_s:
            return self.max_ttl_s, (
                f"ttl_s {ttl_s:g} clipped to the maximum of {self.max_ttl_s:g} s"
            )
        return float(ttl_s), ""

    # ----------------------------------------------------------------- pin
    def _pin_host(
        self, index: int, hint: Hint, extra_key: str | None, data: bytes, until: float,
        note: str, defer: bool,
    ) -> HintOutcome:
        cache, tree = self._cache, self._cache.tree
        kind = HintKind.PIN
        key: _Key = (hint.tenant, "host", extra_key, data)
        asked_pages = len(data) // tree.page_bytes
        asked = asked_pages * cache.page_size
        if cache.host_pool is None:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason="no host tier to pin in (--enable-hierarchical-cache)")
        existing = self._pins.get(key)
        if existing is not None:
            self._refresh(existing, until)
            tokens = existing.pages * cache.page_size
            return self._done(index, kind, tokens, asked - tokens,
                              "pinned before: its TTL is refreshed", note)
        if (why := self._no_room_for_record(hint.tenant)) is not None:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked, reason=why)
        peek = tree.peek_prefix(data, extra_key)
        cached = peek.num_device_pages + peek.num_host_pages
        if cached == 0:
            if defer and cache.storage is not None:
                if len(self._background) >= MAX_PREFETCHES:
                    return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                                       reason="too many prefetches in flight")
                self._start_background([(hint.tenant, extra_key, data, until)],
                                       [_Deferred(hint, extra_key, data, until)])
                return HintOutcome(index, kind, _DEFERRED, clipped_tokens=asked, reason=(
                    "not cached here: prefetching it from L3, pinned when it lands"))
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason="unknown prefix: nothing of it is cached")
        tenant_left = self.tenant_pin_budget_pages - self._tenant_pages[hint.tenant]
        total_left = self.pin_budget_pages - tree.num_pinned_pages
        if tenant_left <= 0 or total_left <= 0:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason=self._budget_reason(hint.tenant))
        match = tree.match_prefix(data[: cached * tree.page_bytes], extra_key)
        path = _path(match.last_node)
        path = self._with_host_copies(path)
        if not path:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason="no host room to copy the prefix to the host tier")
        covered = sum(len(n.tokens) // tree.page_bytes for n in path)  # before any split
        # The longest head of the path within both budgets.
        pages = added = 0
        end: TreeNode | None = None
        for node in path:
            n = len(node.tokens) // tree.page_bytes
            new = n if node.pin_ref == 0 else 0
            fit = min(n, tenant_left - pages, n if new == 0 else total_left - added)
            if fit <= 0:
                break
            if fit < n:
                end = tree.split(node, fit)
                if node.pin_ref == 0:
                    added += fit
                pages += fit
                break
            end, pages, added = node, pages + n, added + new
        if end is None:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason=self._budget_reason(hint.tenant))
        tree.pin(end)
        record = _Pin(key, until, self._next_seq(), pages=pages, node=end)
        self._add(record)
        self._tenant_pages[hint.tenant] += pages
        tokens = pages * cache.page_size
        why = ""
        if pages < asked_pages:
            if pages < covered:
                why = self._budget_reason(hint.tenant)
            elif covered < cached:
                why = f"no host room to copy more than {covered * cache.page_size} tokens"
            else:
                why = f"only {cached * cache.page_size} of the {asked} tokens are cached"
        return self._done(index, kind, tokens, asked - tokens, why, note)

    def _with_host_copies(self, path: list[TreeNode]) -> list[TreeNode]:
        """``path`` (root-first) with a host copy issued for each device-only node; under
        write_through cut before the first that could not get one (a pinned node
        without a host copy would sit on the device), under write_back kept whole."""
        cache = self._cache
        if not path:
            return path
        tree = cache.tree
        # The host-only tail of the path must not be evicted to make room for the copies.
        tree.protect_host(path[-1])
        try:
            for i, node in enumerate(path):
                if node.host_pages is None and not cache.backup_node(node):
                    if tree.write_policy is WritePolicy.WRITE_BACK:
                        return path
                    return path[:i]
        finally:
            tree.unprotect_host(path[-1])
        return path

    def _budget_reason(self, tenant: str) -> str:
        tree = self._cache.tree
        return (
            f"pinned budget full: tenant {tenant!r} holds {self._tenant_pages[tenant]} of its "
            f"{self.tenant_pin_budget_pages} pages, all pins {tree.num_pinned_pages} of "
            f"{self.pin_budget_pages}"
        )

    def _no_room_for_record(self, tenant: str) -> str | None:
        if len(self._pins) >= MAX_RECORDS:
            return f"too many pins: {MAX_RECORDS} are held"
        if self._tenant_records[tenant] >= MAX_RECORDS_PER_TENANT:
            return f"too many pins: tenant {tenant!r} holds {MAX_RECORDS_PER_TENANT}"
        return None

    def _pin_l3(
        self, index: int, hint: Hint, extra_key: str | None, data: bytes, until: float,
        note: str,
    ) -> HintOutcome:
        cache, tree = self._cache, self._cache.tree
        kind = HintKind.PIN
        asked = len(data) // tree.page_bytes * cache.page_size
        storage = cache.storage
        if storage is None:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked,
                               reason="no L3 storage backend is attached")
        if not getattr(storage.controller, "supports_pins", False):
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked, reason=(
                f"the L3 backend {storage.backend.name!r} cannot pin"))
        key: _Key = (hint.tenant, "l3", extra_key, data)
        existing = self._pins.get(key)
        if existing is not None:
            self._refresh(existing, until)
            if not existing.waiting:
                self._send_l3_pin(existing)
            return self._done(index, kind, asked, 0, "pinned before: its TTL is refreshed", note)
        if (why := self._no_room_for_record(hint.tenant)) is not None:
            return HintOutcome(index, kind, _REJECTED, clipped_tokens=asked, reason=why)
        keys = chain_page_keys(data, cache.page_size, tree.seed(extra_key))
        record = _Pin(key, until, self._next_seq(), l3_keys=keys)
        self._add(record)
        nodes = tree.walk_prefix(data, extra_key)
        if not nodes:
            self._send_l3_pin(record)
            return HintOutcome(index, kind, _DEFERRED, tokens=asked, reason=(
                "not cached here: L3 pins what it holds of it"))
        # Write what L3 lacks first (as a drain does): a device-only node is copied to the
        # host, and its L3 write follows when the copy lands.
        for node in nodes:
            if node.l3_stored or storage.backing_up(node) or cache.copying_to_host(node):
                pass
            elif node.host_pages is not None:
                storage.backup(node)
            elif not cache.backup_node(node):
                break
            if cache.copying_to_host(node):
                record.waiting.append(node)
        if record.waiting:
            self._l3_waiting.append(record)
            return HintOutcome(index, kind, _DEFERRED, tokens=asked, reason=(
                "pinned in L3 once its pages are copied to the host and written"))
        self._send_l3_pin(record)
        return self._done(index, kind, asked, 0, "", note)

    def _send_l3_pin(self, record: _Pin) -> None:
        storage = self._cache.storage
        if storage is None or not self._cache.writes_to_l3:
            return  # (an MLA rank but 0 shares rank 0's pages: rank 0 pins them)
        controller = cast(_PinningController, storage.controller)
        until_unix = time.time() + max(0.0, record.until - self._cache.clock())
        controller.pin(record.l3_keys, until_unix)

    # ------------------------------------------------------------- unpin
    def _unpin(self, index: int, tenant: str, extra_key: str | None, data: bytes) -> HintOutcome:
        released = -1
        for tier in TIERS:
            record = self._pins.get((tenant, tier, extra_key, data))
            if record is not None:
                tokens = (record.pages * self._cache.page_size if tier == "host"
                          else len(record.l3_keys) * self._cache.page_size)
                released = max(released, tokens)
                self._release(record)
        cancelled = self._cancel_deferred(tenant, extra_key, data)
        if released < 0 and not cancelled:
            return HintOutcome(index, HintKind.UNPIN, _REJECTED, reason="not pinned")
        return HintOutcome(index, HintKind.UNPIN, _ACCEPTED, tokens=max(released, 0))

    def _cancel_deferred(self, tenant: str, extra_key: str | None, data: bytes) -> bool:
        found = False
        for background in self._background:
            for i, pending in enumerate(background.pins):
                if pending is not None and (pending.hint.tenant, pending.extra_key,
                                            pending.data) == (tenant, extra_key, data):
                    background.pins[i] = None
                    found = True
        return found

    def _release(self, record: _Pin, in_tree: bool = True) -> None:
        del self._pins[record.key]
        self._tenant_records[record.tenant] -= 1
        if not self._tenant_records[record.tenant]:
            del self._tenant_records[record.tenant]
        if record.node is not None:
            if in_tree:
                self._cache.tree.unpin(record.node)
            self._tenant_pages[record.tenant] -= record.pages
            if not self._tenant_pages[record.tenant]:
                del self._tenant_pages[record.tenant]
        if record.l3_keys:
            if record in self._l3_waiting:
                self._l3_waiting.remove(record)  # never sent: nothing to unpin
            elif self._cache.storage is not None and self._cache.writes_to_l3:
                cast(_PinningController, self._cache.storage.controller).unpin(record.l3_keys)

    # ------------------------------------------------------------ retain
    def _retain(
        self, index: int, extra_key: str | None, data: bytes, until: float, note: str
    ) -> HintOutcome:
        tree, page = self._cache.tree, self._cache.page_size
        asked = len(data) // tree.page_bytes * page
        peek = tree.peek_prefix(data, extra_key)
        cached = peek.num_device_pages + peek.num_host_pages
        if cached == 0:
            return HintOutcome(index, HintKind.RETAIN, _REJECTED, clipped_tokens=asked,
                               reason="unknown prefix: nothing of it is cached")
        match = tree.match_prefix(data[: cached * tree.page_bytes], extra_key)
        for node in _path(match.last_node):
            tree.retain(node, until)
        tokens = cached * page
        why = f"only {tokens} of the {asked} tokens are cached" if tokens < asked else ""
        return self._done(index, HintKind.RETAIN, tokens, asked - tokens, why, note)

    # ---------------------------------------------------------- prefetch
    def _prefetch(
        self, index: int, tenant: str, extra_key: str | None, data: bytes,
        prefetches: list[_Item],
    ) -> HintOutcome:
        cache, tree = self._cache, self._cache.tree
        asked = len(data) // tree.page_bytes * cache.page_size
        if cache.storage is None:
            return HintOutcome(index, HintKind.PREFETCH, _REJECTED,
                               reason="no L3 storage backend is attached")
        peek = tree.peek_prefix(data, extra_key)
        missing = asked - (peek.num_device_pages + peek.num_host_pages) * cache.page_size
        if missing <= 0:
            return HintOutcome(index, HintKind.PREFETCH, _ACCEPTED, tokens=asked,
                               reason="already cached")
        if len(self._background) >= MAX_PREFETCHES:
            return HintOutcome(index, HintKind.PREFETCH, _REJECTED,
                               reason="too many prefetches in flight")
        prefetches.append((tenant, extra_key, data, None))
        return HintOutcome(index, HintKind.PREFETCH, _DEFERRED, tokens=missing, reason=(
            f"prefetching the {missing} missing tokens from L3 into the host tier"))

    def _start_background(self, items: list[_Item], pins: list[_Deferred]) -> None:
        """One warm of ``items``; ``pins`` (one per item with a deadline, in order) are
        applied when it is done."""
        warm = L3Warm(
            self._cache, [unpack_tokens(data).tolist() for _, _, data, _ in items],
            self.prefetch_host_fraction, extra_keys=[extra_key for _, extra_key, _, _ in items],
        )
        waiting = iter(pins)
        background = _Background(
            warm, [next(waiting) if until is not None else None for *_, until in items]
        )
        self._background.append(background)
        warm.step()

    # ------------------------------------------------------------ demote
    def _demote(self, index: int, extra_key: str | None, data: bytes) -> HintOutcome:
        tree, page = self._cache.tree, self._cache.page_size
        nodes = tree.walk_prefix(data, extra_key)
        if not nodes:
            return HintOutcome(index, HintKind.DEMOTE, _REJECTED,
                               reason="unknown prefix: nothing of it is cached")
        node = nodes[-1]
        demoted = pinned = 0
        while True:
            n = len(node.tokens) // tree.page_bytes
            tree.demote(node)
            demoted += n
            if node.pin_ref > 0:
                pinned += n
            parent = node.parent
            if parent is None or parent.is_root or len(parent.children) != 1:
                break  # the root, or a node another cached branch shares
            node = parent
        asked = len(data) // tree.page_bytes * page
        tokens = min(demoted * page, asked)
        if pinned:
            return HintOutcome(index, HintKind.DEMOTE, _CLIPPED, tokens=tokens,
                               clipped_tokens=pinned * page,
                               reason=f"{pinned * page} of its tokens are pinned and stay pinned")
        return HintOutcome(index, HintKind.DEMOTE, _ACCEPTED, tokens=tokens)

    # -------------------------------------------------------------- poll
    def poll(self) -> None:
        """Expire what is due, step the background prefetches, send the L3 pins whose
        copies landed. Cheap when there is nothing to do."""
        if not (self._expiry or self._background or self._l3_waiting
                or self._cache.tree.has_retains):
            return
        now = self._cache.clock()
        self._cache.tree.expire_retains(now)
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, key = heapq.heappop(self._expiry)
            record = self._pins.get(key)
            if record is not None and record.seq == seq:
                self._release(record)
        if self._background:
            self._step_background(now)
        if self._l3_waiting:
            cache = self._cache
            for record in list(self._l3_waiting):
                record.waiting = [n for n in record.waiting if cache.copying_to_host(n)]
                if record.waiting:
                    continue
                self._l3_waiting.remove(record)
                storage = cache.storage
                if storage is not None:
                    # The copies landed and their L3 writes are queued: the pin follows them.
                    self._send_l3_pin(record)

    def _step_background(self, now: float) -> None:
        for background in list(self._background):
            background.warm.step()
            if not background.warm.done:
                continue
            self._background.remove(background)
            for pending in background.pins:
                if pending is None or pending.until <= now:
                    continue
                outcome = self._pin_host(-1, pending.hint, pending.extra_key, pending.data,
                                         pending.until, "", defer=False)
                logger.debug("deferred pin landed: %s", outcome)

    # ------------------------------------------------------------ status
    def check_integrity(self) -> None:
        """Every host pin's path is in the tree and pinned; the counts match the records."""
        pins: Counter[int] = Counter()
        tenant_pages: Counter[str] = Counter()
        tenant_records: Counter[str] = Counter()
        for record in self._pins.values():
            tenant_records[record.tenant] += 1
            node = record.node
            if node is None:
                assert record.l3_keys, f"{record.key[:3]}: a pin of neither tier"
                continue
            tenant_pages[record.tenant] += record.pages
            path = _path(node)
            assert path and path[0].parent is self._cache.tree.root, (
                f"{record.key[:3]}: its pinned node left the tree"
            )
            for item in path:
                pins[item.id] += 1
            assert sum(len(n.tokens) for n in path) // self._cache.tree.page_bytes == (
                record.pages
            ), f"{record.key[:3]}: pinned path of another length"
        for node in self._cache.tree.iter_nodes():
            assert node.pin_ref == pins[node.id], f"{node!r}: pins {pins[node.id]} records"
        assert +tenant_pages == +self._tenant_pages, "tenant pinned pages"
        assert +tenant_records == +self._tenant_records, "tenant record counts"

    def status(self) -> dict[str, Any]:
        """For /metrics. ``pinned_pages`` counts each page once; ``pinned_pages_by_tenant``
        what each tenant's pins are charged (each pin its full length)."""
        tree = self._cache.tree
        return {
            "pinned_pages": tree.num_pinned_pages,
            "pinned_pages_by_tenant": dict(self._tenant_pages),
            "retained_pages": tree.num_retained_pages,
            "pin_budget_pages": self.pin_budget_pages,
            "tenant_pin_budget_pages": self.tenant_pin_budget_pages,
            "records": len(self._pins),
            "l3_pins": sum(1 for record in self._pins.values() if record.l3_keys),
            "prefetches": len(self._background),
            "outcomes": dict(self.outcomes),
        }

    def drop_extra_key(self, extra_key: str | None) -> int:
        """Release every pin of a prefix under ``extra_key`` (a tenant purge: its pages are
        going from every tier), host and L3, and cancel the pins waiting for such a prefix
        to land; returns how many pins were released."""
        records = [record for record in self._pins.values()
                   if within_tenant(record.key[2], extra_key)]
        for record in records:
            self._release(record)
        for background in self._background:
            for i, pending in enumerate(background.pins):
                if pending is not None and within_tenant(pending.extra_key, extra_key):
                    background.pins[i] = None
        return len(records)

    def clear(self) -> None:
        """Forget every hint on L1 and L2 (the cache is flushed, after its copies landed):
        background prefetches stop, host pins go (the tree's pins and classes go with the
        tree). L3 keeps its pages through a flush, and so its pins: they stay, to be
        unpinned or to expire; one waiting for its copies is sent now."""
        for background in self._background:
            background.warm.stop()
        self._background.clear()
        for record in list(self._pins.values()):
            if record.node is not None:
                self._release(record, in_tree=False)  # its tree is being dropped
        for record in self._l3_waiting:
            record.waiting = []
            self._send_l3_pin(record)
        self._l3_waiting.clear()

    # --------------------------------------------------------- internals
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _add(self, record: _Pin) -> None:
        self._pins[record.key] = record
        self._tenant_records[record.tenant] += 1
        self._push_expiry(record)

    def _refresh(self, record: _Pin, until: float) -> None:
        record.until = until
        record.seq = self._next_seq()
        self._push_expiry(record)

    def _push_expiry(self, record: _Pin) -> None:
        heapq.heappush(self._expiry, (record.until, record.seq, record.key))
        if len(self._expiry) > 2 * len(self._pins) + 1024:
            # Entries of released or refreshed records: dropped (amortised O(1)).
            self._expiry = [
                e for e in self._expiry
                if (r := self._pins.get(e[2])) is not None and r.seq == e[1]
            ]
            heapq.heapify(self._expiry)

    @staticmethod
    def _done(
        index: int, kind: HintKind, tokens: int, clipped: int, why: str, ttl_note: str
    ) -> HintOutcome:
        reason = "; ".join(part for part in (why, ttl_note) if part)
        outcome = _CLIPPED if clipped > 0 else _ACCEPTED
        return HintOutcome(index, kind, outcome, tokens=tokens, clipped_tokens=max(clipped, 0),
                           reason=reason)


def _path(node: TreeNode) -> list[TreeNode]:
    """root..node without the root, root-first."""
    path: list[TreeNode] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path
