"""TierObserver: told when a node's KV enters or leaves a tier of the tree.

The tree calls it synchronously, at the moment its bookkeeping changes, for
the transitions it decides itself. A device->host copy is not one of them:
the tree records the host pages when the copy is issued, but they hold the KV
only once it lands, which the cache learns and reports (see
``hicache.events.emitter``). Observers run on the tree's thread and must not
block or change the tree.

``pins_changed`` has a default (nothing): an observer that does not care about pins
subclasses ``TierObserver`` and leaves it out.
"""

from __future__ import annotations

from typing import Protocol

from hicache.radix.node import TreeNode


class TierObserver(Protocol):
    def device_stored(self, node: TreeNode) -> None:
        """``node``'s pages are now on the device: a new leaf, or a host-only node
        given device pages (a load-back, or its KV computed again)."""

    def device_removed(self, node: TreeNode) -> None:
        """``node`` lost its device pages: demoted to host-only, or deleted
        (called before it is unlinked, so its parent is still known)."""

    def host_inserted(self, node: TreeNode) -> None:
        """``insert_host`` gave ``node`` host pages whose KV is already there (L3 pages)."""

    def host_removed(self, node: TreeNode) -> None:
        """A host-only ``node`` is deleted: its KV is in no tier of this worker now."""

    def pins_changed(self, node: TreeNode, pinned: bool) -> None:
        """``node``'s host pages were pinned (``pinned``) or lost their last pin (unpinned,
        or the pin's TTL ended): a pinned page is not evicted from the host tier."""
        return None
