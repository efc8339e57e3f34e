"""Drain: write every device (L1) and host (L2) page that L3 lacks to L3, hottest first.

A worker about to exit hands its cache to the shared store, so that the next worker
on that store finds the prefixes this one was serving. ``L3Drain`` runs on the
scheduler thread in steps (``step``), each short: it issues writes and reports
progress; the cache's own ``poll`` (every scheduler tick) moves them on. The caller
bounds the whole by its deadline by ceasing to step: what was written by then is
in L3, whole pages only (each backend's ``set`` makes a page visible only once it is
complete), and what was not is lost with the process, as before.

Invariants:

- order: nodes are taken by ``last_access``, most recent first, parents before their
  children (on ties, as an insert stamps a whole path alike, and always: a planned
  ancestor goes just before its first descendant), so the writes reach the write
  thread, which keeps submission order, hottest first, and a prefix's pages before its
  continuation's (a reader only uses a prefix from its start);
- a device-only node is first copied to the host, as the write path does (its L3 write
  follows when the copy lands, ``HierarchicalCache._acknowledge``); it needs its
  parent on the host (backups stay contiguous from the root): a node whose parent
  could not be copied is skipped, with what hangs from it;
- a host node already being written is not written twice; one this worker saw land in
  L3 (``TreeNode.l3_stored``) is not written again; for the rest the write thread's
  ``set`` skips pages another worker stored meanwhile (``pages_existing``);
- the KV events of the stored pages are those of any backup (``l3_put_done``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hicache.radix.node import TreeNode

if TYPE_CHECKING:
    from hicache.cache.hierarchical_cache import HierarchicalCache


@dataclass(frozen=True)
class DrainProgress:
    """Where a drain stands. Pages: ``pages_to_write`` were planned (in L1 or L2, not
    known to be in L3); of them ``pages_written`` are stored (new in L3) and
    ``pages_existing`` were found there already; ``pages_skipped`` could not be
    written (no host room for a device page's copy, a parent that could not be
    copied, a failed write); ``done``: nothing more will be written."""

    pages_to_write: int = 0
    pages_written: int = 0
    pages_existing: int = 0
    pages_skipped: int = 0
    done: bool = False
    l3_attached: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unstored(node: TreeNode) -> bool:
    """In L1 or L2 and not known to be in L3."""
    return (node.device_pages is not None or node.host_pages is not None) and not node.l3_stored


def pages_lacking(cache: HierarchicalCache) -> int:
    """Pages in L1 or L2 that L3 lacks as far as this worker knows (what a drain plans)."""
    return sum(L3Drain.pages_of(node) for node in cache.tree.iter_nodes() if _unstored(node))


def _depth(node: TreeNode) -> int:
    depth = 0
    cursor = node.parent
    while cursor is not None:
        depth += 1
        cursor = cursor.parent
    return depth


def _parents_first(nodes: list[TreeNode]) -> list[TreeNode]:
    """``nodes`` in their order, but each planned ancestor placed just before its first
    descendant (a hotter child, say one whose parent was split off later): a device-only
    node can only be copied to the host after its parent."""
    planned = {node.id for node in nodes}
    placed: set[int] = set()
    order: list[TreeNode] = []
    for node in nodes:
        chain: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor.id in planned and cursor.id not in placed:
            chain.append(cursor)
            placed.add(cursor.id)
            cursor = cursor.parent
        order.extend(reversed(chain))
    return order


class L3Drain:
    """One drain of ``cache`` into its attached L3 tier (see the module docstring)."""

    def __init__(self, cache: HierarchicalCache) -> None:
        self._cache = cache
        nodes = [node for node in cache.tree.iter_nodes() if _unstored(node)]
        nodes.sort(key=lambda node: (-node.last_access, _depth(node)))
        self._queue: deque[TreeNode] = deque(_parents_first(nodes))
        # Nodes whose write (or host copy, then write) this drain issued or found issued.
        self._issued: list[TreeNode] = []
        self._skipped: set[int] = set()
        self.pages_to_write = sum(self.pages_of(node) for node in nodes)
        self._pages_skipped = 0
        stats = cache.stats
        self._stored_at_start = stats.num_storage_backed_up_pages
        storage = cache.storage
        metrics = storage.metrics() if storage is not None else None
        self._existing_at_start = metrics.backup_pages_existing if metrics else 0
        self._failed_at_start = metrics.backup_pages_failed if metrics else 0

    @staticmethod
    def pages_of(node: TreeNode) -> int:
        pages = node.device_pages if node.device_pages is not None else node.host_pages
        return 0 if pages is None else len(pages)

    def step(self) -> DrainProgress:
        """Issue what can be issued now, then report."""
        cache, storage = self._cache, self._cache.storage
        if storage is None:  # detached meanwhile: nothing more can be written
            self._queue.clear()
            return self.progress()
        while self._queue:
            node = self._queue[0]
            if node.parent is None or (node.device_pages is None and node.host_pages is None):
                self._queue.popleft()  # evicted from both tiers since the plan: gone
                continue
            parent = node.parent
            if parent.id in self._skipped:
                self._skip(node)
                continue
            if storage.backing_up(node) or cache.copying_to_host(node):
                self._issued.append(self._queue.popleft())
                continue
            if node.host_pages is not None:
                storage.backup(node)
                self._issued.append(self._queue.popleft())
                continue
            if not parent.is_root and parent.host_pages is None:
                self._skip(node)  # its parent's copy could not be made
                continue
            if cache.backup_node(node):  # the L3 write follows when the copy lands
                self._issued.append(self._queue.popleft())
                continue
            if self._in_flight():
                break  # no host room yet: the copies and writes in flight will make some
            self._skip(node)
        return self.progress()

    def _skip(self, node: TreeNode) -> None:
        self._queue.popleft()
        self._skipped.add(node.id)
        self._pages_skipped += self.pages_of(node)

    def _in_flight(self) -> bool:
        storage = self._cache.storage
        return any(
            self._cache.copying_to_host(node) or (storage is not None and storage.backing_up(node))
            for node in self._issued
        )

    def progress(self) -> DrainProgress:
        cache, storage = self._cache, self._cache.storage
        metrics = storage.metrics() if storage is not None else None
        existing = metrics.backup_pages_existing - self._existing_at_start if metrics else 0
        failed = metrics.backup_pages_failed - self._failed_at_start if metrics else 0
        in_flight = self._in_flight()
        if not in_flight:
            self._issued.clear()  # every write issued so far has settled
        return DrainProgress(
            pages_to_write=self.pages_to_write,
            pages_written=cache.stats.num_storage_backed_up_pages - self._stored_at_start,
            pages_existing=existing,
            pages_skipped=self._pages_skipped + failed,
            done=not self._queue and not in_flight,
            l3_attached=storage is not None,
        )
