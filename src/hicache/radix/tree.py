"""HiRadixTree: page-granular radix tree recording where each prefix's KV lives.

Pure CPU bookkeeping: no threads, no I/O, no torch. The cache orchestrator
(hicache.cache) turns its decisions into transfers.

Key structure choices, all for the latency of match and insert:
- Tokens are stored as packed int32 bytes; comparing a node is one bytes slice
  and ``==`` (memcmp), and children are found by the bytes of their first page.
  Children of the root are additionally keyed by the request's extra key
  (cache salt), so different salts never share a node.
- Eviction uses one min-heap per tier of (class, last_access, id, node) entries,
  pushed only when a node *may have become* evictable. The class comes from hints
  (``cache/hints.py``): -1 demoted nodes go before ordinary ones (0), retained ones
  (+1, until their deadline) after all of them; within a class, least recently used
  first. A node's key mostly grows (access times only grow, a retain raises the
  class): an entry below the node's key is pushed back with the current key when
  popped. When a key drops (a demote, a retain expiring) a fresh entry is pushed at
  once, so an entry popped with a key *above* the node's is stale and skipped. The
  first valid, current entry popped is therefore the true next candidate, and no
  operation scans the whole tree.
- Retain deadlines sit in their own min-heap of (deadline, id, node), so that
  ``expire_retains`` finds the due ones without a scan; a split node's upper half
  gets its own entry.
- ``lock_ref``, ``host_ref`` and ``pin_ref`` are path counts (root..node), so
  splitting a node copies them to the new upper half and unlocking the original
  node still releases both halves. ``num_pinned_pages`` counts the pages of pinned
  nodes exactly (0<->1 transitions of ``pin_ref``); each is on the host, or is a
  device page a copy to the host will keep (pinned nodes are never deleted).
- Pages are counted per tenant (a node's tenant is its ``extra_key``, the salt its
  root child is keyed by) in each tier, exactly as they come and go: wherever
  ``num_device_pages`` / ``num_host_pages`` change, so does the tenant's count, and
  ``check_integrity`` recounts both. A tenant with a host quota (``host_quotas``, in
  pages) also has its own host heap, fed exactly like the shared one, so that
  ``evict_host_tenant`` finds the tenant's least recently used host pages without
  looking at another tenant's (nor scanning the tree).
- The host tier resists loops (``core_pages``): a cyclic reuse larger than the tier
  (conversations taking turns, more of them than it holds) makes least-recently-used
  eviction drop exactly the prefix that comes back next, so that nothing ever hits.
  As in LIRS, a core set of host pages, up to ``core_pages``, is evicted only after
  every page outside it of its class. Pages join it while it has room, or
  when a page outside it is used again and its previous use is more recent than the
  core set's least recently accessed page (it came back sooner: the workload moved),
  or when a prefix computed again had such a previous use before it left the tree
  (page keys and last uses of deleted pages are kept, bounded, as LIRS keeps entries
  for blocks no longer cached). A page joining a full core set pushes the least
  recently accessed core pages out of it (deepest first on a tie). Copies of pages
  that will not join it evict only pages outside it (``evict_host(include_core=False)``:
  without room there the copy is skipped). So under a loop a fixed part of it stays
  cached and hits every cycle, and pages nobody reuses leave it as reused ones come
  in. The core heap of (last_access, -end, id, node) entries is kept like the others.
  Only a request taking a prefix (``match_prefix(use=True)``) or inserting one counts
  as a use: a prefetch's lookup, a waiting request's touch, a running request's match
  of what it just inserted keep pages from eviction but are not reuse.
- ``remove_tenant`` (a purge) deletes every node of a tenant that nothing holds
  (no lock, host protection or pin), leaves first, telling the observer of each
  tier the pages leave.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from hicache.config import WritePolicy
from hicache.memory.allocator import PageIds
from hicache.radix.keys import TOKEN_BYTES, KeyNamespace, TokenIds, chain_page_keys, pack_tokens
from hicache.radix.node import TreeNode, slice_pages
from hicache.radix.observer import TierObserver
from hicache.radix.results import (
    DeviceEviction,
    HostInsertResult,
    InsertResult,
    MatchResult,
    PrefixPeek,
    no_pages,
)
from hicache.tenancy.names import within_tenant

_HeapEntry = tuple[int, int, int, TreeNode]
_RetainEntry = tuple[float, int, TreeNode]
_CoreEntry = tuple[int, int, int, TreeNode]

DEMOTED, ORDINARY, RETAINED = -1, 0, 1
# Above every eviction key (rank, last_access): ranks run from 2 * DEMOTED to 2 * RETAINED + 1.
_NO_KEY = (2 * RETAINED + 2, 0)


class TreeError(RuntimeError):
    """A call that would break the tree's invariants (a bug in the caller)."""


@dataclass(frozen=True)
class TenantRemoval:
    """What ``remove_tenant`` deleted: the pages to free in each pool, the nodes it
    unlinked (root-last: a child before its parent) and the pages it had to leave
    because something held them (a running request, an L3 call, a pin)."""

    device_pages: PageIds
    host_pages: PageIds
    nodes: list[TreeNode]
    kept_device_pages: int
    kept_host_pages: int


class HiRadixTree:
    def __init__(
        self,
        page_size: int,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        namespace: KeyNamespace | None = None,
        observer: TierObserver | None = None,
        host_quotas: Mapping[str | None, int] | None = None,
        core_pages: int | None = None,
    ) -> None:
        """``host_quotas``: the most host pages each listed tenant may hold (None is the
        default tenant); a listed tenant gets its own host eviction heap. ``core_pages``:
        the size of the host tier's core set (module docstring); None evicts the host
        tier least recently used first, with no core set."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.write_policy = WritePolicy(write_policy)
        self.namespace = namespace or KeyNamespace("default", "", page_size)
        self._seeds: dict[str | None, bytes] = {}
        # Told of tier transitions (KV events); None costs nothing.
        self.observer = observer
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._device_heap: list[_HeapEntry] = []
        self._host_heap: list[_HeapEntry] = []
        self._retain_heap: list[_RetainEntry] = []
        self.num_nodes = 0
        self.num_device_pages = 0
        self.num_host_pages = 0
        self.num_protected_device_pages = 0
        self.num_pinned_pages = 0
        self.num_retained_pages = 0
        # Pages per tenant (extra_key) in each tier; a tenant at 0 is dropped.
        self.device_pages_by_tenant: dict[str | None, int] = {}
        self.host_pages_by_tenant: dict[str | None, int] = {}
        self.host_quotas: dict[str | None, int] = dict(host_quotas or {})
        for tenant, quota in self.host_quotas.items():
            if quota < 0:
                raise ValueError(f"host quota of tenant {tenant!r} must be >= 0, got {quota}")
        self._tenant_host_heaps: dict[str | None, list[_HeapEntry]] = {
            tenant: [] for tenant in self.host_quotas
        }
        if core_pages is not None and core_pages < 0:
            raise ValueError(f"core_pages must be >= 0, got {core_pages}")
        self.core_pages = core_pages
        self.num_core_pages = 0
        self._core_heap: list[_CoreEntry] = []
        # Pages deleted from the tree, by page key, with their last use: the history that
        # lets a prefix computed again join the core set when it came back sooner than
        # the core set's oldest page was used (LIRS's non-resident entries). Bounded.
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self._max_ghosts = 4 * (core_pages or 0) + 1024

    # ------------------------------------------------------------------ sizes
    @property
    def num_evictable_device_pages(self) -> int:
        """Device pages that eviction could free (under write_back, after a copy)."""
        return self.num_device_pages - self.num_protected_device_pages

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, tokens: TokenIds | bytes, extra_key: str | None = None, use: bool = False
    ) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages; splits a node the match ends in.

        Its nodes count as just accessed (least recently used evicted first). ``use``: a
        request takes the prefix (``HierarchicalCache.acquire``), which also counts as a
        use (``last_use``, the core set); other matches (a prefetch, a hint, a waiting
        request's touch, a running request's match of what it just inserted) do not:
        being looked up again by the same request is not being reused."""
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        limit = len(data) - len(data) % self.page_bytes
        self._clock += 1
        node = self.root
        last_device = self.root
        device_parts: list[PageIds] = []
        host_parts: list[PageIds] = []
        pos = 0
        while pos < limit:
            key = self._child_key(node, data[pos : pos + self.page_bytes], extra_key)
            child = node.children.get(key)
            if child is None:
                break
            # startswith at an offset compares in place (no copy of the slice).
            if not data.startswith(child.tokens, pos):
                child = self._split(child, self._common_pages(child.tokens, data, pos, limit))
            child.last_access = self._clock
            if child.evict_class == DEMOTED:
                child.evict_class = ORDINARY  # used again: the conversation is not over
            if use:
                previous, child.last_use = child.last_use, self._clock
                if (self.core_pages is not None and not child.core
                        and child.host_pages is not None):
                    self._maybe_promote(child, previous)
            if child.device_pages is not None:
                device_parts.append(child.device_pages)
                last_device = child
            else:
                assert child.host_pages is not None
                host_parts.append(child.host_pages)
            node = child
            pos += len(child.tokens)
        return MatchResult(
            device_pages=np.concatenate(device_parts) if device_parts else no_pages(),
            host_pages=np.concatenate(host_parts) if host_parts else no_pages(),
            last_device_node=last_device,
            last_node=node,
            page_size=self.page_size,
        )

    def peek_prefix(
        self, tokens: TokenIds | bytes, extra_key: str | None = None
    ) -> PrefixPeek:
        """How much ``match_prefix`` would find, without splitting a node or touching LRU.

        For deciding whether a request fits before committing to it: a request
        that is then refused leaves the tree exactly as it was.
        """
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        limit = len(data) - len(data) % self.page_bytes
        node = self.root
        num_device = num_host = num_unlocked = 0
        pos = 0
        while pos < limit:
            child = node.children.get(self._child_key(node, data[pos : pos + self.page_bytes],
                                                      extra_key))
            if child is None:
                break
            node_pages = len(child.tokens) // self.page_bytes
            if data.startswith(child.tokens, pos):
                num_pages = node_pages
            else:
                num_pages = self._common_pages(child.tokens, data, pos, limit)
            if child.device_pages is not None:
                num_device += num_pages
                if child.lock_ref == 0:
                    num_unlocked += num_pages
            else:
                num_host += num_pages
            if num_pages < node_pages:
                break  # the match ends inside this node
            node = child
            pos += len(child.tokens)
        return PrefixPeek(num_device, num_host, num_unlocked, self.page_size)

    def host_path(self, match: MatchResult) -> list[TreeNode]:
        """Host-only nodes of a match, root-first: what a load-back moves to the device."""
        nodes: list[TreeNode] = []
        node = match.last_node
        while node is not match.last_device_node:
            if node.parent is None:
                raise TreeError("match result is stale: last_device_node is not an ancestor")
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    # ----------------------------------------------------------------- insert
    def insert(
        self, tokens: TokenIds | bytes, device_pages: PageIds, extra_key: str | None = None
    ) -> InsertResult:
        """Record that ``device_pages`` hold the KV of ``tokens`` (whole pages only).

        Where the tree already has the KV on the device, the caller's page is a
        duplicate (returned, to be freed) unless it *is* the tree's page. Where
        the tree has it on the host only, the caller's pages are adopted and
        the node is back on the device.
        """
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        num_pages = len(data) // self.page_bytes
        if len(data) % self.page_bytes or len(device_pages) != num_pages:
            raise TreeError(
                f"insert needs whole pages: {len(data) // TOKEN_BYTES} tokens, page size "
                f"{self.page_size}, {len(device_pages)} pages"
            )
        device_pages = np.asarray(device_pages, dtype=np.int64)
        self._clock += 1
        threshold = self.write_policy.hit_count_threshold
        node = self.root
        duplicates: list[PageIds] = []
        path: list[TreeNode] = []
        pos = 0
        num_cached_pages = 0
        while pos < len(data):
            page = pos // self.page_bytes
            key = self._child_key(node, data[pos : pos + self.page_bytes], extra_key)
            child = node.children.get(key)
            if child is None:
                child = self._new_leaf(node, key, data[pos:], device_pages[page:], extra_key)
                path.append(child)
                break
            if not data.startswith(child.tokens, pos):
                child = self._split(child, self._common_pages(child.tokens, data, pos, len(data)))
            n = len(child.tokens) // self.page_bytes
            mine = device_pages[page : page + n]
            if child.device_pages is None:
                self._adopt_device_pages(child, mine)
            elif mine.tobytes() != child.device_pages.tobytes():  # cheap common case first
                differ = mine != child.device_pages
                duplicates.append(mine[differ])
            num_cached_pages += n
            child.last_access = child.last_use = self._clock
            if child.evict_class == DEMOTED:
                child.evict_class = ORDINARY
            child.hit_count += 1
            path.append(child)
            node = child
            pos += len(child.tokens)
        candidates: list[TreeNode] = []
        if threshold is not None:
            chosen: set[int] = set()
            for item in path:
                parent = item.parent
                assert parent is not None
                parent_ok = parent.is_root or parent.host_pages is not None or parent.id in chosen
                if item.host_pages is None and item.hit_count >= threshold and parent_ok:
                    candidates.append(item)
                    chosen.add(item.id)
        return InsertResult(
            num_cached_tokens=num_cached_pages * self.page_size,
            duplicate_pages=np.concatenate(duplicates) if duplicates else no_pages(),
            last_node=path[-1] if path else self.root,
            backup_candidates=candidates,
        )

    def insert_host(
        self, tokens: TokenIds | bytes, host_pages: PageIds, start_page: int,
        extra_key: str | None = None,
    ) -> HostInsertResult:
        """Record that ``host_pages`` hold the KV of pages ``start_page..`` of ``tokens``.

        This is how pages fetched from L3 enter the tree. Pages before
        ``start_page`` must already be in the tree with host copies (backups
        stay contiguous from the root); the caller protects them while it waits.
        Where the tree already has a host copy, the caller's page is a duplicate
        (returned, to be freed); a device-only node adopts the page as its
        host copy; the rest becomes a new host-only leaf.
        """
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        num_pages = len(data) // self.page_bytes
        host_pages = np.asarray(host_pages, dtype=np.int64)
        if len(data) % self.page_bytes or len(host_pages) != num_pages - start_page:
            raise TreeError(
                f"insert_host needs whole pages: {len(data) // TOKEN_BYTES} tokens, page size "
                f"{self.page_size}, start page {start_page}, {len(host_pages)} pages"
            )
        self._clock += 1
        node = self.root
        duplicates: list[PageIds] = []
        pos = 0
        new_pages = 0
        while pos < len(data):
            page = pos // self.page_bytes
            key = self._child_key(node, data[pos : pos + self.page_bytes], extra_key)
            child = node.children.get(key)
            if child is None:
                if page < start_page:
                    raise TreeError("insert_host: the pages before start_page are not in the tree")
                mine = host_pages[page - start_page :]
                child = self._new_host_leaf(node, key, data[pos:], mine, extra_key)
                new_pages += len(mine)
                node = child
                if self.observer is not None:
                    self.observer.host_inserted(child)
                break
            if not data.startswith(child.tokens, pos):
                child = self._split(child, self._common_pages(child.tokens, data, pos, len(data)))
            n = len(child.tokens) // self.page_bytes
            if page < start_page < page + n:
                child = self._split(child, start_page - page)
                n = start_page - page
            if page < start_page:
                if child.host_pages is None:
                    raise TreeError("insert_host: the pages before start_page have no host copy")
            else:
                mine = host_pages[page - start_page : page - start_page + n]
                if child.host_pages is None:
                    child.host_pages = np.array(mine, dtype=np.int64)
                    self._count_host(child, n)
                    self._admit_host(child)
                    new_pages += n
                    self._push_candidate(child)
                    if self.observer is not None:
                        self.observer.host_inserted(child)
                else:
                    duplicates.append(mine)
            child.last_access = child.last_use = self._clock
            node = child
            pos += len(child.tokens)
        return HostInsertResult(
            duplicate_pages=np.concatenate(duplicates) if duplicates else no_pages(),
            last_node=node,
            num_new_pages=new_pages,
        )

    # ------------------------------------------------------------- locking
    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction in both tiers."""
        while node.parent is not None:
            if node.lock_ref == 0 and node.device_pages is not None:
                self.num_protected_device_pages += len(node.device_pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise TreeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.device_pages is not None:
                    self.num_protected_device_pages -= len(node.device_pages)
                self._push_candidate(node)
            node = node.parent

    def protect_host(self, node: TreeNode) -> None:
        """Keep the host copies of root..node while an L3 operation uses them."""
        while node.parent is not None:
            node.host_ref += 1
            node = node.parent

    def unprotect_host(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.host_ref <= 0:
                raise TreeError(f"unprotect_host of an unprotected node {node!r}")
            node.host_ref -= 1
            if node.host_ref == 0:
                self._push_candidate(node)
            node = node.parent

    # ----------------------------------------------------- tier transitions
    def begin_backup(self, node: TreeNode, host_pages: PageIds) -> None:
        """A device->host copy of ``node`` into ``host_pages`` is being issued.

        The node is locked until ``finish_backup`` so its device copy stays put.
        """
        if node.device_pages is None or node.host_pages is not None:
            raise TreeError(f"begin_backup needs a device-only node, got {node!r}")
        parent = node.parent
        assert parent is not None
        if not parent.is_root and parent.host_pages is None:
            raise TreeError("backups must stay contiguous from the root: back up the parent first")
        if len(host_pages) != len(node.device_pages):
            raise TreeError("host_pages must have one page per node page")
        node.host_pages = np.asarray(host_pages, dtype=np.int64)
        self._count_host(node, len(host_pages))
        self._admit_host(node)
        self.lock(node)

    def finish_backup(self, node: TreeNode) -> None:
        """The copy issued by ``begin_backup`` has landed."""
        self.unlock(node)

    def abort_backup(self, node: TreeNode) -> PageIds:
        """The copy failed: forget the host copy and return its pages to free."""
        if node.host_pages is None:
            raise TreeError(f"abort_backup of a node with no host copy {node!r}")
        if any(child.host_pages is not None for child in node.children.values()):
            raise TreeError("abort_backup of a node whose children are backed up")
        pages = node.host_pages
        self._leave_core(node)
        node.host_pages = None
        self._count_host(node, -len(pages))
        self.unlock(node)
        return pages

    def set_device_pages(self, node: TreeNode, device_pages: PageIds) -> None:
        """A host->device load of a host-only node into ``device_pages`` is being issued."""
        if node.device_pages is not None or node.host_pages is None:
            raise TreeError(f"set_device_pages needs a host-only node, got {node!r}")
        parent = node.parent
        assert parent is not None
        if not parent.is_root and parent.device_pages is None:
            raise TreeError("load parents first: device nodes must hang from the root")
        if len(device_pages) != len(node.host_pages):
            raise TreeError("device_pages must have one page per node page")
        self._adopt_device_pages(node, np.asarray(device_pages, dtype=np.int64))

    def split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``node`` after its first ``num_pages`` pages; returns the new upper node
        (``node`` keeps the rest). Locks and protections cover both halves."""
        if node.parent is None or not 0 < num_pages < len(node.tokens) // self.page_bytes:
            raise TreeError(f"cannot split {node!r} after {num_pages} pages")
        return self._split(node, num_pages)

    def drop_host_subtree(self, node: TreeNode) -> PageIds | None:
        """Delete host-only ``node`` and everything below it; returns their host pages to
        free, or None (nothing deleted) when one of them is on the device, locked or
        protected."""
        below: list[TreeNode] = []
        stack = [node]
        while stack:
            current = stack.pop()
            if (
                current.parent is None
                or current.device_pages is not None
                or current.host_pages is None
                or current.lock_ref
                or current.host_ref
                or current.pin_ref
            ):
                return None
            below.append(current)
            stack.extend(current.children.values())
        # Children before parents: each is a childless leaf when deleted.
        return np.concatenate([self._delete(current) for current in reversed(below)])

    # ---------------------------------------------------------------- hints
    def walk_prefix(self, tokens: TokenIds | bytes, extra_key: str | None = None) -> list[TreeNode]:
        """The nodes holding the cached whole pages of ``tokens``, root-first; the last one
        may reach past them (the match ends inside it). No split, no LRU touch."""
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        limit = len(data) - len(data) % self.page_bytes
        nodes: list[TreeNode] = []
        node = self.root
        pos = 0
        while pos < limit:
            child = node.children.get(
                self._child_key(node, data[pos : pos + self.page_bytes], extra_key)
            )
            if child is None:
                break
            nodes.append(child)
            if not data.startswith(child.tokens, pos):
                break  # the match ends inside this node
            node = child
            pos += len(child.tokens)
        return nodes

    def pin(self, node: TreeNode) -> int:
        """Pin the path root..node; returns the pages that became pinned."""
        added = 0
        while node.parent is not None:
            if node.pin_ref == 0:
                added += len(node.tokens) // self.page_bytes
                if self.observer is not None:
                    self.observer.pins_changed(node, True)
            node.pin_ref += 1
            node = node.parent
        self.num_pinned_pages += added
        return added

    def unpin(self, node: TreeNode) -> int:
        """Release one pin of root..node; returns the pages no pin holds any more."""
        released = 0
        while node.parent is not None:
            if node.pin_ref <= 0:
                raise TreeError(f"unpin of an unpinned node {node!r}")
            node.pin_ref -= 1
            if node.pin_ref == 0:
                released += len(node.tokens) // self.page_bytes
                if self.observer is not None:
                    self.observer.pins_changed(node, False)
                self._push_candidate(node)
            node = node.parent
        self.num_pinned_pages -= released
        return released

    def demote(self, node: TreeNode) -> None:
        """Class -1: evicted before every ordinary node; its retain (if any) ends."""
        node.retain_until = 0.0
        self._set_class(node, DEMOTED)

    def retain(self, node: TreeNode, until: float) -> None:
        """Class +1 until ``until`` (the hint book's clock; a later deadline only extends)."""
        if node.parent is None:
            return
        if node.evict_class == RETAINED and node.retain_until >= until:
            return
        node.retain_until = until
        heapq.heappush(self._retain_heap, (until, node.id, node))
        self._set_class(node, RETAINED)

    def expire_retains(self, now: float) -> int:
        """End the retains due at ``now``; O(1) when none is due. Returns how many ended."""
        heap = self._retain_heap
        ended = 0
        while heap and heap[0][0] <= now:
            until, _, node = heapq.heappop(heap)
            if node.parent is None or node.evict_class != RETAINED or node.retain_until != until:
                continue  # deleted, demoted, or extended (a later entry stands for it)
            node.retain_until = 0.0
            self._set_class(node, ORDINARY)
            ended += 1
        return ended

    @property
    def has_retains(self) -> bool:
        """Is a retain deadline pending (``expire_retains`` may have work)?"""
        return bool(self._retain_heap)

    def _set_class(self, node: TreeNode, cls: int) -> None:
        dropped = cls < node.evict_class
        pages = len(node.tokens) // self.page_bytes
        if node.evict_class == RETAINED:
            self.num_retained_pages -= pages
        if cls == RETAINED:
            self.num_retained_pages += pages
        node.evict_class = cls
        if dropped:
            # The node's entries now sit above its key: a fresh one makes it findable.
            self._push_candidate(node)

    def _current(self, heap: list[_HeapEntry], node: TreeNode, rank: int, stamp: int) -> bool:
        """Is a popped entry (``rank``, ``stamp``) the node's current key? One below it is
        pushed back at the current key; one above it is stale (a fresh one was pushed)."""
        popped = (rank, stamp)
        key = _key(node)
        if popped < key:
            heapq.heappush(heap, _entry(node))
            return False
        return popped == key

    # ------------------------------------------------------------ core set
    def _admit_host(self, node: TreeNode) -> None:
        """``node`` just got its host copy: does it join the core set?"""
        if self.core_pages is None:
            return
        if self.joins_core(node):
            self._join_core(node)

    def _remember(self, node: TreeNode) -> None:
        """``node`` leaves the tree: keep its pages' last use for when they come back."""
        ghosts = self._ghosts
        for key in self.page_keys(node):
            ghosts[key] = node.last_use
            ghosts.move_to_end(key)
        while len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def _maybe_promote(self, node: TreeNode, previous: int) -> None:
        """``node`` (on the host, outside the core set) is used again; it joins the set
        when its previous use is more recent than the oldest core page's last access."""
        oldest = self._oldest_core_access()
        pages = len(node.tokens) // self.page_bytes
        assert self.core_pages is not None
        if self.num_core_pages + pages <= self.core_pages or (
            oldest is not None and previous > oldest
        ):
            self._join_core(node)

    def _join_core(self, node: TreeNode) -> None:
        node.core = True
        self.num_core_pages += len(node.tokens) // self.page_bytes
        heapq.heappush(self._core_heap, self._core_entry(node))
        self._shrink_core(node)

    def _leave_core(self, node: TreeNode) -> None:
        """``node`` loses its host copy (or is pushed out): it leaves the core set."""
        if node.core:
            node.core = False
            self.num_core_pages -= len(node.tokens) // self.page_bytes

    def _shrink_core(self, keep: TreeNode) -> None:
        """Push the least recently used core nodes (but ``keep``) out until the set fits."""
        assert self.core_pages is not None
        heap = self._core_heap
        while self.num_core_pages > self.core_pages and heap:
            entry = heapq.heappop(heap)
            node = entry[3]
            if not node.core or node.parent is None or node is keep:
                continue
            current = self._core_entry(node)
            if entry[:2] != current[:2]:
                if entry[:2] < current[:2]:  # used since: requeue at its current key
                    heapq.heappush(heap, current)
                continue
            self._leave_core(node)
            self._push_candidate(node)  # its eviction key dropped
        if keep.core:
            heapq.heappush(heap, self._core_entry(keep))

    def _oldest_core_access(self) -> int | None:
        """``last_access`` of the least recently used core node (None: the set is empty)."""
        heap = self._core_heap
        while heap:
            entry = heap[0]
            node = entry[3]
            if not node.core or node.parent is None:
                heapq.heappop(heap)
                continue
            current = self._core_entry(node)
            if entry[:2] == current[:2]:
                return node.last_access
            if entry[:2] < current[:2]:
                heapq.heapreplace(heap, current)
            else:
                heapq.heappop(heap)
        return None

    def _core_entry(self, node: TreeNode) -> _CoreEntry:
        """(last_access, -end, id, node): on a tie in last use, the deepest node first."""
        end = 0
        cursor: TreeNode | None = node
        while cursor is not None:
            end += len(cursor.tokens)
            cursor = cursor.parent
        return (node.last_access, -end, node.id, node)

    # ------------------------------------------------------------ eviction
    def evict_device(self, num_pages: int) -> DeviceEviction:
        """Free at least ``num_pages`` device pages if possible, least recently used first.

        A node with a host copy is demoted to host-only; one without is deleted,
        except under write_back, where it (and any ancestors without a host
        copy, for contiguity) is returned in ``pending_write_back`` instead.
        """
        freed: list[PageIds] = []
        pending: list[TreeNode] = []
        pending_ids: set[int] = set()
        counted = demoted = deleted = 0
        write_back = self.write_policy is WritePolicy.WRITE_BACK
        while counted < num_pages and self._device_heap:
            cls, stamp, _, node = heapq.heappop(self._device_heap)
            if not self._device_evictable(node) or node.id in pending_ids:
                continue
            if not self._current(self._device_heap, node, cls, stamp):
                continue
            assert node.device_pages is not None
            counted += len(node.device_pages)
            if node.host_pages is not None:
                freed.append(self._demote(node))
                demoted += 1
            elif write_back:
                chain = self._unbacked_chain(node)
                pending.extend(n for n in chain if n.id not in pending_ids)
                pending_ids.update(n.id for n in chain)
            else:
                freed.append(self._delete(node))
                deleted += 1
        # Pending nodes stay candidates: if their backup cannot be issued, a later
        # call must still find them (once locked for backup they are skipped).
        for node in pending:
            if self._device_evictable(node):
                heapq.heappush(self._device_heap, _entry(node))
        return DeviceEviction(
            freed_pages=np.concatenate(freed) if freed else no_pages(),
            pending_write_back=pending,
            num_demoted_nodes=demoted,
            num_deleted_nodes=deleted,
        )

    def evict_host(self, num_pages: int, include_core: bool = True) -> PageIds:
        """Delete host-only leaves, least recently used first; returns the freed host pages.

        ``include_core=False`` (room for pages that will not join the core set: see
        ``joins_core``) deletes only pages outside the core set, as LIRS keeps its
        resident set for the pages with the shorter reuse: it stops at the first ordinary
        core leaf (a demoted one is passed over, retained ones come later anyway)."""
        heap = self._host_heap
        freed: list[PageIds] = []
        passed: list[_HeapEntry] = []
        got = 0
        while got < num_pages and heap:
            rank, stamp, _, node = entry = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            if not self._current(heap, node, rank, stamp):
                continue
            if node.core and not include_core:
                passed.append(entry)
                if node.evict_class == DEMOTED:
                    continue
                break
            pages = self._delete(node)
            got += len(pages)
            freed.append(pages)
        for entry in passed:
            heapq.heappush(heap, entry)
        return np.concatenate(freed) if freed else no_pages()

    def joins_core(self, node: TreeNode) -> bool:
        """Would ``node`` join the core set once on the host: is there room, or was its
        prefix here before and is it back sooner than the core set's oldest page was last
        used? (True without a core set: every page may then take any other's place.)"""
        if self.core_pages is None:
            return True
        if self.num_core_pages + len(node.tokens) // self.page_bytes <= self.core_pages:
            return True
        seen = self._ghosts.get(self.page_keys(node)[0])
        if seen is None:
            return False
        oldest = self._oldest_core_access()
        return oldest is not None and seen > oldest

    def evict_host_tenant(self, extra_key: str | None, num_pages: int) -> PageIds:
        """Delete the host-only leaves of one tenant with a host quota, least recently used
        first, until ``num_pages`` are freed or none is evictable; another tenant's pages
        are never looked at. Returns the freed host pages."""
        heap = self._tenant_host_heaps.get(extra_key)
        if heap is None:
            raise TreeError(f"tenant {extra_key!r} has no host quota: no heap of its own")
        freed: list[PageIds] = []
        got = 0
        while got < num_pages and heap:
            cls, stamp, _, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            if not self._current(heap, node, cls, stamp):
                continue
            pages = self._delete(node)
            got += len(pages)
            freed.append(pages)
        return np.concatenate(freed) if freed else no_pages()

    # ---------------------------------------------------------------- tenants
    def host_quota(self, extra_key: str | None) -> int | None:
        """The most host pages the tenant may hold (None: no quota of its own)."""
        return self.host_quotas.get(extra_key)

    def tenant_device_pages(self, extra_key: str | None) -> int:
        return self.device_pages_by_tenant.get(extra_key, 0)

    def tenant_host_pages(self, extra_key: str | None) -> int:
        return self.host_pages_by_tenant.get(extra_key, 0)

    def remove_tenant(self, extra_key: str | None) -> TenantRemoval:
        """Delete every node of the tenant that nothing holds, in both tiers, children
        before parents; the observer hears each tier the pages leave (device, then host).

        A node something holds (a lock, an L3 call's host protection, a pin) stays, and
        so do its ancestors, which those counts cover too: the tree stays a tree. The
        pages of the nodes left are counted in the result.
        """
        # The tenant's own namespace and those nested in it (its salts, tenancy/names.py).
        tops = [child for child in self.root.children.values()
                if within_tenant(child.extra_key, extra_key)]
        order: list[TreeNode] = []
        stack = tops
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        device: list[PageIds] = []
        host: list[PageIds] = []
        removed: list[TreeNode] = []
        kept_device = kept_host = 0
        for node in reversed(order):  # every descendant before its ancestors
            if node.lock_ref or node.host_ref or node.pin_ref or node.children:
                kept_device += 0 if node.device_pages is None else len(node.device_pages)
                kept_host += 0 if node.host_pages is None else len(node.host_pages)
                continue
            parent = node.parent
            assert parent is not None
            if self.observer is not None:
                if node.device_pages is not None:
                    self.observer.device_removed(node)
                if node.host_pages is not None:
                    self.observer.host_removed(node)
            if node.device_pages is not None:
                device.append(node.device_pages)
                self._count_device(node, -len(node.device_pages))
            if node.host_pages is not None:
                host.append(node.host_pages)
                self._leave_core(node)
                self._count_host(node, -len(node.host_pages))
            if node.evict_class == RETAINED:
                self.num_retained_pages -= len(node.tokens) // self.page_bytes
            key = self._child_key(parent, node.tokens[: self.page_bytes], node.extra_key)
            del parent.children[key]
            node.parent = None
            node.device_pages = node.host_pages = None
            self.num_nodes -= 1
            removed.append(node)
            self._push_candidate(parent)  # a kept parent may be evictable now
        return TenantRemoval(
            device_pages=np.concatenate(device) if device else no_pages(),
            host_pages=np.concatenate(host) if host else no_pages(),
            nodes=removed,
            kept_device_pages=kept_device,
            kept_host_pages=kept_host,
        )

    def _count_device(self, node: TreeNode, delta: int) -> None:
        self.num_device_pages += delta
        _add(self.device_pages_by_tenant, node.extra_key, delta)

    def _count_host(self, node: TreeNode, delta: int) -> None:
        self.num_host_pages += delta
        _add(self.host_pages_by_tenant, node.extra_key, delta)

    # ----------------------------------------------------------- page keys
    def page_keys(self, node: TreeNode) -> list[bytes]:
        """Chained page keys of ``node`` (radix.keys), computed on first use."""
        if node.page_keys is not None:
            return node.page_keys
        missing: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor.parent is not None and cursor.page_keys is None:
            missing.append(cursor)
            cursor = cursor.parent
        for item in reversed(missing):
            parent = item.parent
            assert parent is not None
            if parent.is_root:
                prev = self.seed(item.extra_key)
            else:
                assert parent.page_keys is not None
                prev = parent.page_keys[-1]
            item.page_keys = chain_page_keys(item.tokens, self.page_size, prev)
        assert node.page_keys is not None
        return node.page_keys

    def seed(self, extra_key: str | None) -> bytes:
        seed = self._seeds.get(extra_key)
        if seed is None:
            seed = self._seeds[extra_key] = self.namespace.seed(extra_key)
        return seed

    # -------------------------------------------------------------- walking
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_page_ids(self) -> PageIds:
        parts = [n.device_pages for n in self.iter_nodes() if n.device_pages is not None]
        return np.concatenate(parts) if parts else no_pages()

    def host_page_ids(self) -> PageIds:
        parts = [n.host_pages for n in self.iter_nodes() if n.host_pages is not None]
        return np.concatenate(parts) if parts else no_pages()

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Assert every structural invariant; raises AssertionError naming the broken one."""
        num_nodes = dev = host = protected = pinned = retained = core = 0
        core_stamps: dict[int, int] = {}
        for stamp, _, node_id, _ in self._core_heap:
            core_stamps[node_id] = min(stamp, core_stamps.get(node_id, stamp))
        device_keys = _lowest_keys(self._device_heap)
        host_keys = _lowest_keys(self._host_heap)
        retain_entries = {(entry[1], entry[0]) for entry in self._retain_heap}
        tenant_keys = {t: _lowest_keys(h) for t, h in self._tenant_host_heaps.items()}
        device_by_tenant: dict[str | None, int] = {}
        host_by_tenant: dict[str | None, int] = {}
        for node in self.iter_nodes():
            num_nodes += 1
            parent = node.parent
            assert parent is not None
            pages = len(node.tokens) // self.page_bytes
            assert pages > 0 and len(node.tokens) % self.page_bytes == 0, f"{node!r}: partial page"
            key = self._child_key(parent, node.tokens[: self.page_bytes], node.extra_key)
            assert parent.children.get(key) is node, f"{node!r}: not under its key in its parent"
            assert node.device_pages is not None or node.host_pages is not None, (
                f"{node!r}: in no tier"
            )
            if node.device_pages is not None:
                assert len(node.device_pages) == pages, f"{node!r}: device page count"
                assert parent.is_root or parent.device_pages is not None, (
                    f"{node!r}: on device under a parent that is not"
                )
                dev += pages
                _add(device_by_tenant, node.extra_key, pages)
                if node.lock_ref > 0:
                    protected += pages
            if node.host_pages is not None:
                assert len(node.host_pages) == pages, f"{node!r}: host page count"
                assert parent.is_root or parent.host_pages is not None, (
                    f"{node!r}: backup not contiguous from the root"
                )
                host += pages
                _add(host_by_tenant, node.extra_key, pages)
            assert node.extra_key == parent.extra_key or parent.is_root, (
                f"{node!r}: another tenant than its parent"
            )
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
                f"{node!r}: lock count below its children's"
            )
            assert node.host_ref >= sum(c.host_ref for c in node.children.values()), (
                f"{node!r}: host_ref below its children's"
            )
            if node.page_keys is not None:
                assert len(node.page_keys) == pages, f"{node!r}: page key count"
            assert node.pin_ref >= sum(c.pin_ref for c in node.children.values()), (
                f"{node!r}: pin count below its children's"
            )
            if node.pin_ref > 0:
                pinned += pages
            assert node.evict_class in (DEMOTED, ORDINARY, RETAINED), f"{node!r}: bad class"
            if node.evict_class == RETAINED:
                retained += pages
                assert (node.id, node.retain_until) in retain_entries, (
                    f"{node!r}: retained without a deadline entry"
                )
            if node.core:
                assert node.host_pages is not None, f"{node!r}: in the core set, not on the host"
                core += pages
                # Some entry at or below its last use (shrinking requeues those below).
                assert core_stamps.get(node.id, node.last_access + 1) <= node.last_access, (
                    f"{node!r}: in the core set without an entry in its heap"
                )
            # Evictable: some entry at or below its key (one above it is stale).
            evict_key = _key(node)
            if self._device_evictable(node):
                assert device_keys.get(node.id, _NO_KEY) <= evict_key, (
                    f"{node!r}: evictable but not an eviction candidate at its key"
                )
            if self._host_evictable(node):
                assert host_keys.get(node.id, _NO_KEY) <= evict_key, (
                    f"{node!r}: host-evictable but not a candidate at its key"
                )
                own = tenant_keys.get(node.extra_key)
                if own is not None:
                    assert own.get(node.id, _NO_KEY) <= evict_key, (
                        f"{node!r}: host-evictable but not in its tenant's heap at its key"
                    )
        assert num_nodes == self.num_nodes, f"node count {self.num_nodes} != {num_nodes}"
        assert pinned == self.num_pinned_pages, (
            f"pinned pages {self.num_pinned_pages} != {pinned}"
        )
        assert retained == self.num_retained_pages, (
            f"retained pages {self.num_retained_pages} != {retained}"
        )
        assert core == self.num_core_pages, f"core pages {self.num_core_pages} != {core}"
        assert self.core_pages is not None or core == 0, "a core set without a budget"
        assert dev == self.num_device_pages, f"device pages {self.num_device_pages} != {dev}"
        assert host == self.num_host_pages, f"host pages {self.num_host_pages} != {host}"
        assert device_by_tenant == self.device_pages_by_tenant, (
            f"device pages by tenant {self.device_pages_by_tenant} != {device_by_tenant}"
        )
        assert host_by_tenant == self.host_pages_by_tenant, (
            f"host pages by tenant {self.host_pages_by_tenant} != {host_by_tenant}"
        )
        assert protected == self.num_protected_device_pages, (
            f"protected pages {self.num_protected_device_pages} != {protected}"
        )
        device_ids = self.device_page_ids()
        assert len(np.unique(device_ids)) == len(device_ids), "a device page is in two nodes"
        host_ids = self.host_page_ids()
        assert len(np.unique(host_ids)) == len(host_ids), "a host page is in two nodes"

    # ------------------------------------------------------------- internals
    def _child_key(self, parent: TreeNode, first_page: bytes, extra_key: str | None) -> bytes:
        if parent.parent is not None or extra_key is None:
            return first_page
        # Under the root, salt the key so different extra keys never share a node.
        salt = extra_key.encode()
        return len(salt).to_bytes(4, "little") + salt + first_page

    def _common_pages(self, node_tokens: bytes, data: bytes, pos: int, limit: int) -> int:
        """Whole pages shared by ``node_tokens`` and ``data[pos:limit]`` (>= 1 by the child key)."""
        n = min(len(node_tokens), limit - pos) // TOKEN_BYTES
        mine = np.frombuffer(node_tokens, dtype="<i4", count=n)
        theirs = np.frombuffer(data, dtype="<i4", count=n, offset=pos)
        mismatch = np.flatnonzero(mine != theirs)
        same = int(mismatch[0]) if len(mismatch) else n
        return same // self.page_size

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Split ``child`` after ``num_pages`` pages; returns the new upper node."""
        assert 0 < num_pages < len(child.tokens) // self.page_bytes
        parent = child.parent
        assert parent is not None
        cut = num_pages * self.page_bytes
        key = self._child_key(parent, child.tokens[: self.page_bytes], child.extra_key)
        upper = TreeNode(child.tokens[:cut], parent, child.extra_key)
        upper.device_pages = slice_pages(child.device_pages, 0, num_pages)
        upper.host_pages = slice_pages(child.host_pages, 0, num_pages)
        upper.lock_ref = child.lock_ref
        upper.host_ref = child.host_ref
        upper.pin_ref = child.pin_ref
        upper.evict_class = child.evict_class
        upper.retain_until = child.retain_until
        upper.hit_count = child.hit_count
        upper.last_access = child.last_access
        upper.last_use = child.last_use
        upper.l3_stored = child.l3_stored
        upper.core = child.core  # the pages are counted once, either side of the cut
        if child.page_keys is not None:
            upper.page_keys = child.page_keys[:num_pages]
            child.page_keys = child.page_keys[num_pages:]
        if child.event_digests is not None:
            upper.event_digests = child.event_digests[:num_pages]
            child.event_digests = child.event_digests[num_pages:]
        child.tokens = child.tokens[cut:]
        child.device_pages = slice_pages(child.device_pages, num_pages)
        child.host_pages = slice_pages(child.host_pages, num_pages)
        child.parent = upper
        upper.children[child.tokens[: self.page_bytes]] = child
        parent.children[key] = upper
        self.num_nodes += 1
        if upper.evict_class == RETAINED:
            heapq.heappush(self._retain_heap, (upper.retain_until, upper.id, upper))
        if upper.core:
            heapq.heappush(self._core_heap, self._core_entry(upper))
        return upper

    def _new_leaf(
        self, parent: TreeNode, key: bytes, tokens: bytes, device_pages: PageIds,
        extra_key: str | None,
    ) -> TreeNode:
        leaf = TreeNode(tokens, parent, extra_key)
        leaf.device_pages = np.array(device_pages, dtype=np.int64)
        leaf.last_access = leaf.last_use = self._clock
        leaf.hit_count = 1
        parent.children[key] = leaf
        self.num_nodes += 1
        self._count_device(leaf, len(device_pages))
        heapq.heappush(self._device_heap, _entry(leaf))
        if self.observer is not None:
            self.observer.device_stored(leaf)
        return leaf

    def _new_host_leaf(
        self, parent: TreeNode, key: bytes, tokens: bytes, host_pages: PageIds,
        extra_key: str | None,
    ) -> TreeNode:
        leaf = TreeNode(tokens, parent, extra_key)
        leaf.host_pages = np.array(host_pages, dtype=np.int64)
        leaf.last_access = leaf.last_use = self._clock
        parent.children[key] = leaf
        self.num_nodes += 1
        self._count_host(leaf, len(host_pages))
        self._push_candidate(leaf)
        return leaf

    def _adopt_device_pages(self, node: TreeNode, device_pages: PageIds) -> None:
        node.device_pages = np.array(device_pages, dtype=np.int64)
        self._count_device(node, len(device_pages))
        if node.lock_ref > 0:
            self.num_protected_device_pages += len(device_pages)
        self._push_candidate(node)
        if self.observer is not None:
            self.observer.device_stored(node)

    def _demote(self, node: TreeNode) -> PageIds:
        """Drop the device copy of a backed-up node; it stays in the tree, host-only."""
        pages = node.device_pages
        assert pages is not None and node.host_pages is not None and node.lock_ref == 0
        if self.observer is not None:
            self.observer.device_removed(node)
        node.device_pages = None
        self._count_device(node, -len(pages))
        self._push_candidate(node)
        assert node.parent is not None
        self._push_candidate(node.parent)
        return pages

    def _delete(self, node: TreeNode) -> PageIds:
        """Remove a childless, unlocked node; returns the pages of the tier it was in."""
        assert not node.children and node.lock_ref == 0 and node.host_ref == 0
        assert node.pin_ref == 0, f"{node!r}: a pinned node is never deleted"
        if self.core_pages is not None:
            self._remember(node)
        if node.evict_class == RETAINED:  # evicted once nothing ordinary was left
            self.num_retained_pages -= len(node.tokens) // self.page_bytes
        parent = node.parent
        assert parent is not None
        if self.observer is not None:
            if node.device_pages is not None:
                self.observer.device_removed(node)
            else:
                self.observer.host_removed(node)
        del parent.children[self._child_key(parent, node.tokens[: self.page_bytes], node.extra_key)]
        node.parent = None
        self.num_nodes -= 1
        if node.device_pages is not None:
            # Only unbacked device leaves are deleted from the device tier.
            assert node.host_pages is None
            pages = node.device_pages
            self._count_device(node, -len(pages))
        else:
            assert node.host_pages is not None
            pages = node.host_pages
            self._leave_core(node)
            self._count_host(node, -len(pages))
        node.device_pages = node.host_pages = None
        self._push_candidate(parent)
        return pages

    def _unbacked_chain(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors without a host copy, root-first."""
        chain: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor.parent is not None and cursor.host_pages is None:
            chain.append(cursor)
            cursor = cursor.parent
        chain.reverse()
        return chain

    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device_pages is not None
            and node.lock_ref == 0
            # A pinned node without a host copy is not deleted; write_back copies it first.
            and (node.pin_ref == 0 or node.host_pages is not None
                 or self.write_policy is WritePolicy.WRITE_BACK)
            and not node.has_device_child()
        )

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device_pages is None
            and node.host_pages is not None
            and node.lock_ref == 0
            and node.host_ref == 0
            and node.pin_ref == 0
            and not node.children
        )

    def _push_candidate(self, node: TreeNode) -> None:
        entry = _entry(node)
        if self._device_evictable(node):
            heapq.heappush(self._device_heap, entry)
        elif self._host_evictable(node):
            heapq.heappush(self._host_heap, entry)
            tenant_heap = self._tenant_host_heaps.get(node.extra_key)
            if tenant_heap is not None:
                heapq.heappush(tenant_heap, entry)
        else:
            return
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop stale heap entries once they outnumber live nodes (amortised O(1))."""
        limit = 2 * self.num_nodes + 1024
        if len(self._device_heap) > limit:
            self._device_heap = _one_current_entry(self._device_heap, self._device_evictable)
        if len(self._host_heap) > limit:
            self._host_heap = _one_current_entry(self._host_heap, self._host_evictable)
        for tenant, heap in self._tenant_host_heaps.items():
            if len(heap) > limit:
                self._tenant_host_heaps[tenant] = _one_current_entry(heap, self._host_evictable)
        if len(self._retain_heap) > limit:
            self._retain_heap = [e for e in self._retain_heap if _current_retain(e)]
            heapq.heapify(self._retain_heap)
        if len(self._core_heap) > limit:
            live = {e[3].id: e[3] for e in self._core_heap if e[3].core and e[3].parent}
            self._core_heap = [self._core_entry(n) for n in live.values()]
            heapq.heapify(self._core_heap)


def _one_current_entry(
    heap: list[_HeapEntry], evictable: Callable[[TreeNode], bool]
) -> list[_HeapEntry]:
    """The heap rebuilt with one entry per candidate still evictable, at its current key
    (every evictable node has an entry, so none is lost)."""
    nodes = {entry[3].id: entry[3] for entry in heap if evictable(entry[3])}
    rebuilt = [_entry(n) for n in nodes.values()]
    heapq.heapify(rebuilt)
    return rebuilt


def _add(counts: dict[str | None, int], tenant: str | None, delta: int) -> None:
    """Add ``delta`` to the tenant's count, dropping it at 0 (the dict stays as small as
    the set of tenants holding pages)."""
    total = counts.get(tenant, 0) + delta
    assert total >= 0, f"tenant {tenant!r}: page count below zero"
    if total:
        counts[tenant] = total
    else:
        counts.pop(tenant, None)


def _key(node: TreeNode) -> tuple[int, int]:
    """A node's eviction key: its rank (class, then outside the core set before in it),
    then its last use."""
    return (2 * node.evict_class + node.core, node.last_access)


def _entry(node: TreeNode) -> _HeapEntry:
    return (2 * node.evict_class + node.core, node.last_access, node.id, node)


def _lowest_keys(heap: list[_HeapEntry]) -> dict[int, tuple[int, int]]:
    """The lowest (rank, last_access) of each node's entries in ``heap``."""
    keys: dict[int, tuple[int, int]] = {}
    for rank, stamp, node_id, _ in heap:
        key = (rank, stamp)
        if key < keys.get(node_id, _NO_KEY):
            keys[node_id] = key
    return keys


def _current_retain(entry: _RetainEntry) -> bool:
    until, _, node = entry
    return node.parent is not None and node.evict_class == RETAINED and node.retain_until == until
