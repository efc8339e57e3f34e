"""KVEventEmitter: the cache's tier transitions as KV events, one batch per scheduler step.

Each tier transition and its event (the media of Dynamo's KV event table), as this
cache produces them (medium in brackets):

    fresh prefill (a new device leaf)                  store [GPU]
    device->host copy landed (not when issued)         store [CPU_PINNED]
    device copy dropped, host copy kept (demotion)     remove [GPU]
    device-only node evicted                           remove [GPU]
    host-only node evicted (gone from every tier here) remove [CPU_PINNED]
    host->device load-back, or KV computed again       store [GPU]
    L3 prefetch materialised into host pages           store [CPU_PINNED], then
                                                       store [EXTERNAL] unless announced
    this worker's L3 backup put succeeded              store [EXTERNAL] (the pages stored)
    /flush_cache                                       AllBlocksCleared
    tenant purge (DELETE /hicache/tenants/{tenant})    remove [GPU] and/or [CPU_PINNED]
                                                       for each node, then, once its L3
                                                       objects are purged, remove
                                                       [EXTERNAL] for those of its pages
                                                       this worker saw in L3
    host pages pinned / unpinned (with pin_events)     pinned [CPU_PINNED] true / false

Events go out in the order the transitions happen on the scheduler thread, so
within a step a page's store in its new tier precedes its removal from the
old one (a demotion only follows a landed copy; a load-back removes nothing).

EXTERNAL means "this worker put or found these pages in L3": there is no
removal, since pages leave the shared store by other evictors and other
instances without this worker learning of it, except a tenant purge, which this
worker ordered. A router should take the shared
pool's own answer (a batch existence query) as the truth and these events as
a hint. Announcements are remembered (a bounded set of hashes, cleared with
the cache) so a page fetched again is not announced again; one forgotten is
announced twice, which routers treat as the no-op it is.

Hashes (``events.hashing``): per full page, chained from the parent page, so
the router computes the same values from a request's token ids. Each node
keeps its pages' digests (``TreeNode.event_digests``, split with the node) and
a child chains from its parent's last one: a page is hashed once, when it
first enters the tree. The tenant (the node's extra key, the request's cache
salt) is part of the hashes: a root child's first page chains from
``hashing.tenant_root_digest(extra_key)``, which is nothing for the default tenant
(its hashes are SGLang's, unchanged) and a per-tenant digest otherwise. So two
tenants' copies of the same tokens announce different hashes, and a router that
hashes a request with its tenant never counts another tenant's pages as hits.

Nothing here runs when events are off: the cache then has no emitter and the
tree no observer, so no page is ever hashed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from hicache.events.hashing import digest_to_hash, packed_page_digests, tenant_root_digest
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
)
from hicache.events.publisher import EventPublisher
from hicache.radix.keys import unpack_tokens
from hicache.radix.node import TreeNode
from hicache.radix.observer import TierObserver

# Page hashes remembered as announced EXTERNAL (about 100 bytes each).
EXTERNAL_MEMORY_PAGES: Final = 1 << 16


@dataclass(frozen=True)
class PageRun:
    """The pages of one node as an event names them, captured when a copy is issued."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]

    def head(self, num_pages: int, page_size: int) -> PageRun:
        """The first ``num_pages`` pages (same parent)."""
        return PageRun(
            self.block_hashes[:num_pages], self.parent_block_hash,
            self.token_ids[: num_pages * page_size],
        )


class KVEventEmitter(TierObserver):
    """Implements the tree's TierObserver; the cache calls the copy and L3 hooks.

    Runs on the scheduler thread only. ``end_step`` hands what the step
    produced to the publisher as one batch. ``pin_events``: pins are published
    (``BlockPinned``); without it they are not, and the stream stays one SGLang's
    router decodes.
    """

    def __init__(
        self, page_size: int, publisher: EventPublisher, pin_events: bool = False,
    ) -> None:
        self.page_size = page_size
        self.publisher = publisher
        self.pin_events = pin_events
        self._pending: list[KVEvent] = []
        # Copies in flight, by node id: captured when issued, so a node split
        # meanwhile still reports every page the copy moved.
        self._host_copies: dict[int, PageRun] = {}
        self._l3_puts: dict[int, PageRun] = {}
        self._external: dict[int, None] = {}  # insertion-ordered set, oldest first
        self.num_events = 0

    # ------------------------------------------------------- TierObserver
    def device_stored(self, node: TreeNode) -> None:
        self._stored(self.run(node), MEDIUM_GPU)

    def device_removed(self, node: TreeNode) -> None:
        self._removed(node, MEDIUM_GPU)

    def host_inserted(self, node: TreeNode) -> None:
        # Only L3 pages enter the tree this way: they are in L3 as well.
        run = self.run(node)
        self._stored(run, MEDIUM_CPU)
        self._announce_external(run, only_new=True)

    def host_removed(self, node: TreeNode) -> None:
        self._removed(node, MEDIUM_CPU)

    def pins_changed(self, node: TreeNode, pinned: bool) -> None:
        if self.pin_events:
            hashes = [digest_to_hash(d) for d in self._digests(node)]
            self._pending.append(BlockPinned(block_hashes=hashes, pinned=pinned,
                                             medium=MEDIUM_CPU))

    # ------------------------------------------------------- the cache's hooks
    def host_copy_issued(self, node: TreeNode) -> None:
        self._host_copies[node.id] = self.run(node)

    def host_copy_landed(self, node: TreeNode) -> None:
        self._stored(self._host_copies.pop(node.id), MEDIUM_CPU)

    def l3_put_issued(self, node: TreeNode) -> None:
        self._l3_puts[node.id] = self.run(node)

    def l3_put_done(self, node: TreeNode, num_stored_pages: int) -> None:
        """The put ended with its first ``num_stored_pages`` pages in L3 (0: it failed)."""
        run = self._l3_puts.pop(node.id)
        if num_stored_pages > 0:
            self._announce_external(run.head(num_stored_pages, self.page_size), only_new=False)

    def l3_removed(self, nodes: list[TreeNode]) -> None:
        """A tenant purge removed the tenant's L3 objects: the pages of ``nodes`` (removed
        from L1 and L2 by the same purge, so hashed already) that this worker announced in
        L3 leave EXTERNAL, and are forgotten as announced."""
        for node in nodes:
            if node.event_digests is None:
                continue  # never hashed: never announced
            hashes = [digest_to_hash(d) for d in node.event_digests]
            gone = [h for h in hashes if node.l3_stored or h in self._external]
            for h in gone:
                self._external.pop(h, None)
            if gone:
                self._pending.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_EXTERNAL))

    def cleared(self) -> None:
        """Every page left L1 and L2 (a flush); L3 announcements are forgotten too,
        as a router drops all of this worker's blocks on AllBlocksCleared."""
        self._pending.append(AllBlocksCleared())
        self._host_copies.clear()
        self._external.clear()

    def end_step(self) -> None:
        """Publish the step's events as one batch (nothing when there were none)."""
        if self._pending:
            events, self._pending = self._pending, []
            self.num_events += len(events)
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    # ------------------------------------------------------------- hashing
    def run(self, node: TreeNode) -> PageRun:
        digests = self._digests(node)
        parent = node.parent
        assert parent is not None, "the root has no pages"
        parent_hash = None
        if not parent.is_root:
            assert parent.event_digests is not None
            parent_hash = digest_to_hash(parent.event_digests[-1])
        return PageRun(
            [digest_to_hash(d) for d in digests], parent_hash,
            unpack_tokens(node.tokens).tolist(),
        )

    def _digests(self, node: TreeNode) -> list[bytes]:
        """``node``'s page digests, hashing it (and any ancestors not yet hashed) once."""
        if node.event_digests is not None:
            return node.event_digests
        missing: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and not cursor.is_root and cursor.event_digests is None:
            missing.append(cursor)
            cursor = cursor.parent
        for item in reversed(missing):
            parent = item.parent
            assert parent is not None
            # A root child starts its tenant's chain (root children are keyed by tenant).
            last = (tenant_root_digest(item.extra_key) if parent.is_root
                    else parent.event_digests[-1])  # type: ignore[index]
            item.event_digests = packed_page_digests(item.tokens, self.page_size, last)
        assert node.event_digests is not None
        return node.event_digests

    # ------------------------------------------------------------- events
    def _stored(self, run: PageRun, medium: str) -> None:
        self._pending.append(BlockStored(
            block_hashes=run.block_hashes, parent_block_hash=run.parent_block_hash,
            token_ids=run.token_ids, block_size=self.page_size, lora_id=None, medium=medium,
        ))

    def _removed(self, node: TreeNode, medium: str) -> None:
        hashes = [digest_to_hash(d) for d in self._digests(node)]
        self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def _announce_external(self, run: PageRun, only_new: bool) -> None:
        known = self._external
        if only_new and all(h in known for h in run.block_hashes):
            return
        self._stored(run, MEDIUM_EXTERNAL)
        for h in run.block_hashes:
            known.pop(h, None)  # re-inserted as the newest
            known[h] = None
        while len(known) > EXTERNAL_MEMORY_PAGES:
            del known[next(iter(known))]
