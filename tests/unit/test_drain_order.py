"""The drain's write order (``cache/drain.py``): hottest first, yet every planned ancestor
just before its first descendant, so a device-only node is never planned before its parent."""

from __future__ import annotations

from hicache.cache.drain import _parents_first
from hicache.radix.node import TreeNode


def test_an_ancestor_goes_just_before_its_first_descendant() -> None:
    root = TreeNode()
    parent = TreeNode(b"p", root)
    child = TreeNode(b"c", parent)
    grandchild = TreeNode(b"g", child)
    other = TreeNode(b"o", root)
    unplanned = TreeNode(b"u", root)  # e.g. known stored: not in the plan
    below_unplanned = TreeNode(b"b", unplanned)

    order = _parents_first([grandchild, other, parent, below_unplanned, child])

    assert order == [parent, child, grandchild, other, below_unplanned]


def test_an_order_with_parents_first_is_kept() -> None:
    root = TreeNode()
    first, second = TreeNode(b"1", root), TreeNode(b"2", root)
    below = TreeNode(b"3", first)
    assert _parents_first([second, first, below]) == [second, first, below]
