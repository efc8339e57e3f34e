"""Deterministic HiRadixTree behaviour: matching, splits, LRU order, policies, salts, keys."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.config import WritePolicy
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.radix.tree import HiRadixTree, TreeError


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_match_is_page_granular_and_splits_inside_a_node() -> None:
    tree = HiRadixTree(page_size=4)
    tree.insert(list(range(12)), pages(7, 8, 9))
    # 10 tokens: two whole pages match, the partial third page is ignored.
    match = tree.match_prefix(list(range(10)))
    assert match.device_pages.tolist() == [7, 8]
    assert match.num_tokens == 8
    assert tree.num_nodes == 2  # the 3-page node was split at the match boundary
    # A mismatch inside the second page stops the match at the first page.
    other = [*range(4), 4, 5, 99, 7]
    assert tree.match_prefix(other).device_pages.tolist() == [7]
    tree.check_integrity()


def test_insert_returns_duplicates_and_keeps_the_trees_own_pages() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], pages(0, 1))
    # Same prefix computed again into other pages (a concurrent request).
    result = tree.insert([1, 2, 3, 4, 5, 6], pages(5, 1, 6))
    assert result.num_cached_tokens == 4
    assert result.duplicate_pages.tolist() == [5]  # page 1 is the tree's own
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).device_pages.tolist() == [0, 1, 6]
    with pytest.raises(TreeError):
        tree.insert([1, 2, 3], pages(0, 1))  # not whole pages
    tree.check_integrity()


def test_device_eviction_is_lru_and_skips_locked_paths() -> None:
    tree = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_BACK)
    for i, start in enumerate((10, 20, 30)):
        tree.insert([start, start + 1], pages(2 * i, 2 * i + 1))
    tree.match_prefix([10, 11])  # touched after 30 was inserted
    locked = tree.match_prefix([20, 21]).last_node  # touched and locked
    tree.lock(locked)
    ev = tree.evict_device(1)
    # 30 is now the least recently used unlocked leaf; under write_back it needs
    # a host copy before its device pages can go.
    assert [n.tokens for n in ev.pending_write_back] == [pack_tokens([30, 31])]
    assert len(ev.freed_pages) == 0
    node = ev.pending_write_back[0]
    tree.begin_backup(node, pages(100, 101))
    tree.check_integrity()
    assert len(tree.evict_device(2).freed_pages) == 0  # locked while its copy is in flight
    tree.finish_backup(node)
    ev = tree.evict_device(2)
    assert ev.freed_pages.tolist() == [4, 5] and ev.num_demoted_nodes == 1
    match = tree.match_prefix([30, 31])
    assert match.device_pages.tolist() == [] and match.host_pages.tolist() == [100, 101]
    tree.unlock(locked)
    tree.check_integrity()


def test_lru_order_follows_access_not_insertion() -> None:
    tree = HiRadixTree(page_size=1)
    for i in range(4):
        tree.insert([i], pages(i))
    tree.match_prefix([0])
    tree.match_prefix([2])
    order = [int(tree.evict_device(1).freed_pages[0]) for _ in range(4)]
    assert order == [1, 3, 0, 2]


def test_parents_become_candidates_after_their_children() -> None:
    tree = HiRadixTree(page_size=1)
    tree.insert([1, 2, 3], pages(0, 1, 2))
    tree.insert([1, 2, 9], pages(0, 1, 3))
    assert sorted(tree.evict_device(2).freed_pages.tolist()) == [2, 3]
    assert sorted(tree.evict_device(5).freed_pages.tolist()) == [0, 1]
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_write_through_backs_up_root_first_and_selective_waits_for_a_second_hit() -> None:
    tree = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_THROUGH)
    tree.insert([1, 2], pages(0, 1))
    result = tree.insert([1, 2, 3], pages(0, 1, 2))
    assert [n.num_tokens for n in result.backup_candidates] == [2, 1]
    selective = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    assert selective.insert([1, 2], pages(0, 1)).backup_candidates == []
    assert [n.num_tokens for n in selective.insert([1, 2], pages(0, 1)).backup_candidates] == [2]
    back = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_BACK)
    back.insert([1, 2], pages(0, 1))
    assert back.insert([1, 2], pages(0, 1)).backup_candidates == []


def test_backup_must_be_contiguous_from_the_root() -> None:
    tree = HiRadixTree(page_size=1)
    tree.insert([1, 2], pages(0, 1))
    tree.insert([1, 2, 3], pages(0, 1, 2))
    child = tree.match_prefix([1, 2, 3]).last_node
    with pytest.raises(TreeError, match="contiguous"):
        tree.begin_backup(child, pages(9))


def test_host_eviction_respects_protection_and_load_back_restores_device() -> None:
    tree = HiRadixTree(page_size=1)
    result = tree.insert([1, 2], pages(0, 1))
    node = result.backup_candidates[0]
    tree.begin_backup(node, pages(10, 11))
    tree.finish_backup(node)
    assert tree.evict_device(2).freed_pages.tolist() == [0, 1]
    tree.protect_host(node)
    assert len(tree.evict_host(2)) == 0
    tree.unprotect_host(node)
    tree.check_integrity()
    match = tree.match_prefix([1, 2, 5])
    assert match.host_pages.tolist() == [10, 11] and match.last_device_node is tree.root
    (loaded,) = tree.host_path(match)
    tree.set_device_pages(loaded, pages(3, 4))
    assert tree.match_prefix([1, 2]).device_pages.tolist() == [3, 4]
    assert tree.evict_device(2).freed_pages.tolist() == [3, 4]
    assert tree.evict_host(2).tolist() == [10, 11]
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_protection_dropped_during_eviction_is_restored_on_unprotect() -> None:
    tree = HiRadixTree(page_size=1)
    node = tree.insert([1], pages(0)).backup_candidates[0]
    tree.begin_backup(node, pages(5))
    tree.finish_backup(node)
    tree.evict_device(1)
    tree.protect_host(node)
    assert len(tree.evict_host(1)) == 0  # pops and drops the protected candidate
    tree.unprotect_host(node)
    tree.check_integrity()
    assert tree.evict_host(1).tolist() == [5]


def test_extra_keys_never_share_nodes() -> None:
    tree = HiRadixTree(page_size=1)
    tree.insert([1, 2], pages(0, 1), extra_key="tenant-a")
    assert tree.match_prefix([1, 2]).num_tokens == 0
    assert tree.match_prefix([1, 2], extra_key="tenant-b").num_tokens == 0
    assert tree.match_prefix([1, 2], extra_key="tenant-a").num_tokens == 2
    tree.check_integrity()


def test_page_keys_chain_and_namespace() -> None:
    ns = KeyNamespace(model="m", kv_layout="L2-H1-D4-bfloat16", page_size=2)
    tree = HiRadixTree(page_size=2, namespace=ns)
    tree.insert([1, 2, 3, 4], pages(0, 1))
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    keys = tree.page_keys(node)
    assert keys == chain_page_keys(pack_tokens([1, 2, 3, 4]), 2, ns.seed())
    # A split keeps the keys: the halves' keys are the prefix's keys.
    tree.match_prefix([1, 2, 7, 7])
    upper = tree.match_prefix([1, 2]).last_node
    assert tree.page_keys(upper) == keys[:1] and tree.page_keys(node) == keys[1:]
    # Different salt, model or geometry: different keys for the same tokens.
    data = pack_tokens([1, 2])
    seeds = {
        ns.seed(), ns.seed("salt"), ns.seed(""),
        KeyNamespace("other", ns.kv_layout, 2).seed(),
        KeyNamespace("m", "L2-H1-D4-float16", 2).seed(),
        KeyNamespace("m", ns.kv_layout, 2, tp_rank=1, tp_size=2).seed(),
    }
    assert len({chain_page_keys(data, 2, s)[0] for s in seeds}) == len(seeds) == 6


def test_token_ids_are_validated() -> None:
    with pytest.raises(ValueError):
        pack_tokens([1, -1])
    with pytest.raises(ValueError):
        pack_tokens(np.zeros((2, 2), dtype=np.int64))


def test_insert_host_adds_an_l3_continuation_as_host_only_pages() -> None:
    tree = HiRadixTree(page_size=2)
    result = tree.insert([1, 2, 3, 4], pages(0, 1))
    tree.begin_backup(result.last_node, pages(10, 11))
    tree.finish_backup(result.last_node)
    # Pages 2.. came from L3 into host pages 20, 21; the prefix is on both tiers.
    added = tree.insert_host([1, 2, 3, 4, 5, 6, 7, 8], pages(20, 21), start_page=2)
    assert added.num_new_pages == 2 and len(added.duplicate_pages) == 0
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert match.device_pages.tolist() == [0, 1]
    assert match.host_pages.tolist() == [20, 21]
    assert tree.host_path(match) == [added.last_node]
    # The same continuation fetched again: every page is a duplicate.
    again = tree.insert_host([1, 2, 3, 4, 5, 6, 7, 8], pages(30, 31), start_page=2)
    assert again.duplicate_pages.tolist() == [30, 31] and again.num_new_pages == 0
    tree.check_integrity()
    # The new leaf is host-evictable like any host-only leaf.
    assert tree.evict_host(2).tolist() == [20, 21]
    tree.check_integrity()


def test_insert_host_adopts_device_only_nodes_and_splits_at_the_start_page() -> None:
    tree = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_BACK)
    prefix = tree.insert([1, 2], pages(0, 1)).last_node
    tree.begin_backup(prefix, pages(10, 11))
    tree.finish_backup(prefix)
    # A device-only continuation computed meanwhile by another request.
    tree.insert([1, 2, 3, 4, 5], pages(0, 1, 2, 3, 4))
    added = tree.insert_host([1, 2, 3, 4, 5, 6], pages(22, 23, 24, 25), start_page=2)
    # 3, 4, 5 were device-only: they adopt 22..24 as their host copy; 6 is new.
    assert added.num_new_pages == 4 and len(added.duplicate_pages) == 0
    match = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.device_pages.tolist() == [0, 1, 2, 3, 4]
    assert match.host_pages.tolist() == [25]
    tree.check_integrity()
    # The device copy can now be dropped without losing the KV (demotion).
    evicted = tree.evict_device(5)
    assert sorted(evicted.freed_pages.tolist()) == [0, 1, 2, 3, 4]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).host_pages.tolist() == [10, 11, 22, 23, 24, 25]
    tree.check_integrity()


def test_insert_host_refuses_a_prefix_without_host_copy() -> None:
    tree = HiRadixTree(page_size=1, write_policy=WritePolicy.WRITE_BACK)
    tree.insert([1, 2], pages(0, 1))
    with pytest.raises(TreeError, match="no host copy"):
        tree.insert_host([1, 2, 3], pages(5), start_page=2)
    with pytest.raises(TreeError, match="not in the tree"):
        tree.insert_host([9, 9, 3], pages(5), start_page=2)
    with pytest.raises(TreeError, match="whole pages"):
        tree.insert_host([1, 2, 3], pages(5, 6), start_page=2)
    tree.check_integrity()
