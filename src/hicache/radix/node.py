"""TreeNode: one run of whole pages and where its KV lives (device, host, or both)."""

from __future__ import annotations

from itertools import count

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.radix.keys import TOKEN_BYTES

_node_ids = count(1)


class TreeNode:
    """A radix-tree node.

    Invariants (checked by HiRadixTree.check_integrity):
    - ``tokens`` holds a whole number of pages (int32 little-endian bytes).
    - ``device_pages`` / ``host_pages`` are None or hold one page id per page.
    - A node on the device has its parent on the device (device nodes form a
      subtree hanging from the root); a node on the host has its parent on the
      host (backups are contiguous from the root).
    - ``lock_ref`` counts users of the path root..node (requests, in-flight
      device writes and loads); a locked node is never evicted from either tier.
    - ``host_ref`` counts in-flight L3 operations on the host copy; a protected
      host copy is never evicted.
    - ``pin_ref`` counts pins (hints, ``cache/hints.py``) of the path root..node: a
      pinned node's host copy is never evicted and, without one, it is not deleted
      from the device (write_back copies it to the host first).
    - ``evict_class`` orders eviction before ``last_access``: -1 demoted (first), 0
      ordinary, +1 retained until ``retain_until`` (after every ordinary node).
    - ``core`` (only with a host copy) orders host eviction within a class: outside
      the core set first.
    """

    __slots__ = (
        "children",
        "core",
        "device_pages",
        "event_digests",
        "evict_class",
        "extra_key",
        "hit_count",
        "host_pages",
        "host_ref",
        "id",
        "l3_stored",
        "last_access",
        "last_use",
        "lock_ref",
        "page_keys",
        "parent",
        "pin_ref",
        "retain_until",
        "tokens",
    )

    def __init__(
        self,
        tokens: bytes = b"",
        parent: TreeNode | None = None,
        extra_key: str | None = None,
    ) -> None:
        self.id = next(_node_ids)
        self.tokens = tokens
        self.parent = parent
        self.extra_key = extra_key
        self.children: dict[bytes, TreeNode] = {}
        self.device_pages: PageIds | None = None
        self.host_pages: PageIds | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.pin_ref = 0
        # Eviction class (-1 demoted, 0 ordinary, +1 retained) and, when retained, the
        # deadline on the hint book's clock (0.0: not retained).
        self.evict_class = 0
        self.retain_until = 0.0
        self.hit_count = 0
        self.last_access = 0
        # The clock of its last match or insert: ``last_access`` without the touches of
        # waiting requests, so that being waited for does not count as a reuse.
        self.last_use = 0
        # In the host tier's core set (HiRadixTree's ``core_pages``): evicted from the
        # host only after every node outside it of its class. Only a node on the host.
        self.core = False
        # This worker saw every page of the node land in L3 (a finished backup); a drain
        # skips such nodes. False says nothing: L3 may hold it all the same.
        self.l3_stored = False
        # Chained page keys (radix.keys), computed lazily: only L3 needs them.
        self.page_keys: list[bytes] | None = None
        # Per-page digests of the KV event hashes (events.hashing), kept by the event
        # emitter only when events are on, so children chain without rehashing.
        self.event_digests: list[bytes] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def has_device_child(self) -> bool:
        return any(child.device_pages is not None for child in self.children.values())

    def __repr__(self) -> str:
        where = ("D" if self.on_device else "") + ("H" if self.on_host else "")
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, at={where or '-'}, "
            f"lock={self.lock_ref}, host_ref={self.host_ref}, pin={self.pin_ref}, "
            f"class={self.evict_class}, core={self.core}, hits={self.hit_count})"
        )


def slice_pages(pages: PageIds | None, start: int, stop: int | None = None) -> PageIds | None:
    """Copying slice, so a split node never aliases its sibling's page array."""
    if pages is None:
        return None
    return np.array(pages[start:stop], dtype=np.int64)
