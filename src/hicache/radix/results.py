"""Typed results of HiRadixTree operations."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.radix.node import TreeNode


def no_pages() -> PageIds:
    return np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class MatchResult:
    """A matched prefix: first the device-resident pages, then the host-resident ones.

    ``last_device_node`` ends the device part (the root when nothing is on the
    device); ``last_node`` ends the whole match. Nodes strictly between them are
    host-only and are what a load-back brings to the device.
    """

    device_pages: PageIds
    host_pages: PageIds
    last_device_node: TreeNode
    last_node: TreeNode
    page_size: int

    @property
    def num_device_tokens(self) -> int:
        return len(self.device_pages) * self.page_size

    @property
    def num_host_tokens(self) -> int:
        return len(self.host_pages) * self.page_size

    @property
    def num_tokens(self) -> int:
        return self.num_device_tokens + self.num_host_tokens


@dataclass(frozen=True)
class PrefixPeek:
    """What ``match_prefix`` would find, measured without changing the tree.

    ``num_unlocked_device_pages`` of the device part are evictable now and
    stop being so once the match is locked.
    """

    num_device_pages: int
    num_host_pages: int
    num_unlocked_device_pages: int
    page_size: int

    @property
    def num_device_tokens(self) -> int:
        return self.num_device_pages * self.page_size

    @property
    def num_host_tokens(self) -> int:
        return self.num_host_pages * self.page_size


@dataclass(frozen=True)
class InsertResult:
    """What an insert did with the caller's pages.

    ``duplicate_pages`` are caller pages the tree did not take because it
    already held that KV on the device: the caller must free them.
    ``backup_candidates`` (root-first) crossed the write-through hit threshold
    and may be copied to the host now (see HiRadixTree.begin_backup).
    """

    num_cached_tokens: int
    duplicate_pages: PageIds
    last_node: TreeNode
    backup_candidates: list[TreeNode] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceEviction:
    """Outcome of one evict_device call.

    ``freed_pages`` left the tree and go back to the device allocator.
    ``pending_write_back`` (write_back policy, root-first) need a host copy
    before their device pages can go: back them up, then evict again.
    """

    freed_pages: PageIds
    pending_write_back: list[TreeNode]
    num_demoted_nodes: int
    num_deleted_nodes: int


@dataclass(frozen=True)
class HostInsertResult:
    """What insert_host did with the caller's host pages.

    ``duplicate_pages`` were already held on the host by the tree: free them.
    ``num_new_pages`` of the caller's pages are now owned by the tree.
    """

    duplicate_pages: PageIds
    last_node: TreeNode
    num_new_pages: int
