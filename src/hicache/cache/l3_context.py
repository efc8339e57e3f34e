"""What the L3 tier may see and change of the cache it serves: ``L3Context``.

The tier (``cache/l3.py``) reaches the cache only through this object, which
``HierarchicalCache`` builds when it attaches a store: the radix tree's operations
that a prefetch or a backup needs, the host pages it allocates and frees, the
device->host copy that makes a prefetch's anchor host-backed, and the counters and
events it reports. Nothing else of the cache (its pools, controller, other tiers) is
in reach, so what L3 can do to the cache is read here.

Invariants:
- values a running cache may change are read when used, never copied: a flush
  replaces the tree, and the replicated scheduler turns ``replicated`` on and
  installs its tick clock, possibly after the tier was attached;
- everything runs on the scheduler thread, as the cache does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.cache.stats import CacheStats
    from hicache.events.emitter import KVEventEmitter
    from hicache.memory.allocator import PageIds
    from hicache.radix.node import TreeNode
    from hicache.radix.tree import HiRadixTree


@dataclass(frozen=True)
class L3Context:
    page_size: int
    # Host pages in the pool (the prefetch budget is a fraction of them).
    host_num_pages: int
    # False on an MLA rank other than 0: rank 0 writes the pages they share.
    writes_to_l3: bool
    stats: CacheStats
    events: KVEventEmitter | None  # None: KV events are off
    # The tree as it is now (a flush replaces it).
    tree: Callable[[], HiRadixTree]
    # Under tensor parallelism: decide on the ranks' agreed values, by the tick clock.
    replicated: Callable[[], bool]
    clock: Callable[[], float]
    # Up to n free host pages, evicting host-only leaves for room.
    alloc_host: Callable[[int, str | None], PageIds]  # (pages, tenant): within its quota
    free_host: Callable[[PageIds], None]
    # Start copying a device-only node to the host; False when the host has no room.
    backup_node: Callable[[TreeNode], bool]
    # Bytes of one host page (what an L3 read moves per page: its bandwidth's unit).
    host_page_bytes: int = 0
