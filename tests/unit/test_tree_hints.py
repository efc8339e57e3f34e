"""HiRadixTree eviction classes and pins: demoted nodes go first, retained ones last (until
their deadline, found without a scan), pinned nodes are never evicted from the host nor
deleted from the device, splits keep pins and classes, and check_integrity sees it all."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.config import WritePolicy
from hicache.radix.keys import pack_tokens
from hicache.radix.node import TreeNode
from hicache.radix.tree import DEMOTED, ORDINARY, RETAINED, HiRadixTree, TreeError


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def three_leaves(policy: WritePolicy = WritePolicy.WRITE_THROUGH_SELECTIVE) -> HiRadixTree:
    """Leaves [10,11] (oldest), [20,21], [30,31] (newest) on the device, no host copy."""
    tree = HiRadixTree(page_size=1, write_policy=policy)
    for i, start in enumerate((10, 20, 30)):
        tree.insert([start, start + 1], pages(2 * i, 2 * i + 1))
    return tree


def leaf(tree: HiRadixTree, start: int) -> TreeNode:
    return tree.walk_prefix([start, start + 1])[-1]


def evicted_order(tree: HiRadixTree) -> list[int]:
    """First token of each leaf as device eviction deletes them one by one."""
    order: list[int] = []
    while True:
        before = {n.tokens for n in tree.iter_nodes()}
        if not len(tree.evict_device(1).freed_pages):
            return order
        gone = before - {n.tokens for n in tree.iter_nodes()}
        order.extend(int(np.frombuffer(t, dtype="<i4")[0]) for t in gone)
        tree.check_integrity()


def test_plain_lru_order_is_unchanged() -> None:
    assert evicted_order(three_leaves()) == [10, 20, 30]


def test_demoted_go_first_and_retained_last() -> None:
    tree = three_leaves()
    tree.retain(leaf(tree, 10), until=100.0)  # the oldest, kept last
    tree.demote(leaf(tree, 30))  # the newest, evicted first
    tree.check_integrity()
    assert evicted_order(tree) == [30, 20, 10]


def test_a_retain_expires_at_its_deadline_and_later_retains_extend() -> None:
    tree = three_leaves()
    node = leaf(tree, 10)
    tree.retain(node, until=5.0)
    tree.retain(node, until=9.0)  # extends
    tree.retain(node, until=7.0)  # shorter: no change
    assert tree.expire_retains(8.0) == 0 and node.evict_class == RETAINED
    assert tree.expire_retains(9.0) == 1 and node.evict_class == ORDINARY
    assert not tree.has_retains
    tree.check_integrity()
    # Ordinary again, and the oldest: evicted first (its key dropped: a fresh entry).
    assert evicted_order(tree) == [10, 20, 30]


def test_an_access_ends_a_demote() -> None:
    tree = three_leaves()
    tree.demote(leaf(tree, 20))
    assert leaf(tree, 20).evict_class == DEMOTED
    tree.match_prefix([20, 21])
    assert leaf(tree, 20).evict_class == ORDINARY
    tree.check_integrity()
    assert evicted_order(tree) == [10, 30, 20]


def test_a_demote_drops_the_retain() -> None:
    tree = three_leaves()
    node = leaf(tree, 30)
    tree.retain(node, until=50.0)
    tree.demote(node)
    assert node.retain_until == 0.0
    assert tree.expire_retains(60.0) == 0  # its entry is stale
    assert node.evict_class == DEMOTED
    tree.check_integrity()


def test_split_keeps_pins_and_classes() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert(list(range(8)), pages(0, 1, 2, 3))
    node = tree.walk_prefix(list(range(8)))[-1]
    tree.pin(node)
    tree.retain(node, until=10.0)
    assert tree.num_pinned_pages == 4
    tree.match_prefix(list(range(4)))  # splits after two pages
    upper, lower = tree.walk_prefix(list(range(8)))
    assert (upper.pin_ref, lower.pin_ref) == (1, 1)
    assert upper.evict_class == lower.evict_class == RETAINED
    assert tree.num_pinned_pages == 4
    tree.check_integrity()
    # The upper half has its own deadline entry: both expire.
    assert tree.expire_retains(10.0) == 2
    assert tree.unpin(lower) == 4 and tree.num_pinned_pages == 0
    with pytest.raises(TreeError):
        tree.unpin(lower)
    tree.check_integrity()


def test_pinned_host_copy_is_never_evicted() -> None:
    tree = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_THROUGH)
    for i, start in enumerate((10, 20)):
        result = tree.insert([start, start + 1], pages(2 * i, 2 * i + 1))
        node = result.last_node
        tree.begin_backup(node, pages(100 + 2 * i, 101 + 2 * i))
        tree.finish_backup(node)
    tree.pin(leaf(tree, 10))
    assert len(tree.evict_device(4).freed_pages) == 4  # device copies go: demoted to host
    freed = tree.evict_host(4)
    assert sorted(freed.tolist()) == [102, 103]  # only the unpinned one
    assert tree.walk_prefix([10, 11])[-1].host_pages is not None
    tree.check_integrity()
    tree.unpin(leaf(tree, 10))
    assert sorted(tree.evict_host(4).tolist()) == [100, 101]  # a candidate again
    tree.check_integrity()


def test_pinned_device_only_node_is_not_deleted_under_write_through() -> None:
    tree = three_leaves(WritePolicy.WRITE_THROUGH)
    tree.pin(leaf(tree, 10))
    assert evicted_order(tree) == [20, 30]
    assert leaf(tree, 10).device_pages is not None
    tree.check_integrity()


def test_pinned_device_only_node_goes_to_the_host_under_write_back() -> None:
    tree = three_leaves(WritePolicy.WRITE_BACK)
    node = leaf(tree, 10)
    tree.pin(node)
    eviction = tree.evict_device(1)
    assert [n.tokens for n in eviction.pending_write_back] == [pack_tokens([10, 11])]
    tree.begin_backup(node, pages(100, 101))
    tree.finish_backup(node)
    assert len(tree.evict_device(2).freed_pages) == 2  # demoted, host copy kept
    assert node.host_pages is not None and node.device_pages is None
    assert len(tree.evict_host(2)) == 0
    tree.check_integrity()


def test_integrity_catches_a_wrong_pin_count() -> None:
    tree = three_leaves()
    tree.pin(leaf(tree, 10))
    tree.num_pinned_pages += 1
    with pytest.raises(AssertionError, match="pinned pages"):
        tree.check_integrity()


def test_integrity_catches_a_dropped_key_without_a_fresh_entry() -> None:
    tree = three_leaves()
    node = leaf(tree, 20)
    tree.retain(node, until=5.0)
    node.evict_class = DEMOTED  # behind the tree's back: no fresh entry, no drop of retain
    with pytest.raises(AssertionError):
        tree.check_integrity()


def test_many_demotes_and_retains_keep_the_heaps_bounded() -> None:
    tree = three_leaves()
    node = leaf(tree, 10)
    for i in range(5000):
        tree.retain(node, until=float(i + 1))
        tree.demote(node)
    assert len(tree._retain_heap) < 2 * tree.num_nodes + 1100
    assert len(tree._device_heap) < 2 * tree.num_nodes + 1100
    tree.check_integrity()


def test_walk_prefix_neither_splits_nor_touches() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert(list(range(8)), pages(0, 1, 2, 3))
    node = tree.walk_prefix(list(range(8)))[-1]
    stamp = node.last_access
    assert tree.walk_prefix([0, 1, 2, 3, 9, 9]) == [node]  # ends inside it: no split
    assert tree.num_nodes == 1 and node.last_access == stamp
    assert tree.walk_prefix([5, 5]) == []
