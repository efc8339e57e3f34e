"""Per-tenant bookkeeping of HiRadixTree: page counts per tier kept exactly, a tenant's
own host heap evicting only its pages, and remove_tenant deleting all of a tenant that
nothing holds (and nothing of another's)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.radix.node import TreeNode
from hicache.radix.tree import HiRadixTree, TreeError


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def backed_up(tree: HiRadixTree, tokens: list[int], device: np.ndarray, host: np.ndarray,
              tenant: str | None) -> TreeNode:
    """Insert ``tokens`` for ``tenant`` on the device and back the whole node up."""
    node = tree.insert(tokens, device, tenant).last_node
    tree.begin_backup(node, host)
    tree.finish_backup(node)
    return node


def test_counts_follow_pages_through_every_transition() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], pages(0, 1), "a")
    tree.insert([1, 2, 3, 4], pages(2, 3), "b")  # same tokens, another tenant: its own node
    tree.insert([5, 6], pages(4), None)
    assert tree.device_pages_by_tenant == {"a": 2, "b": 2, None: 1}
    assert tree.host_pages_by_tenant == {}
    node = tree.match_prefix([1, 2, 3, 4], "a").last_node
    tree.begin_backup(node, pages(10, 11))
    assert tree.host_pages_by_tenant == {"a": 2}
    tree.finish_backup(node)
    tree.check_integrity()
    # Demote a's pages (device copy dropped, host kept), then evict them from the host.
    tree.evict_device(5)
    assert tree.device_pages_by_tenant == {}
    assert tree.host_pages_by_tenant == {"a": 2}
    tree.check_integrity()
    assert sorted(tree.evict_host(2).tolist()) == [10, 11]
    assert tree.host_pages_by_tenant == {}
    # L3 pages enter as host pages of the request's tenant; a split keeps the counts.
    tree.insert_host([7, 8, 9, 10], pages(20, 21), 0, "c")
    tree.match_prefix([7, 8, 0, 0], "c")  # splits c's node
    assert tree.host_pages_by_tenant == {"c": 2}
    tree.check_integrity()


def test_integrity_check_catches_a_wrong_tenant_count() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert([1, 2], pages(0), "a")
    tree.device_pages_by_tenant["a"] += 1
    with pytest.raises(AssertionError, match="device pages by tenant"):
        tree.check_integrity()


def test_tenant_eviction_takes_only_the_tenants_lru_pages() -> None:
    tree = HiRadixTree(page_size=2, host_quotas={"a": 4})
    backed_up(tree, [1, 2], pages(0), pages(10), "a")        # a's oldest
    backed_up(tree, [3, 4], pages(1), pages(11), "b")        # b's, older than a's newer
    backed_up(tree, [5, 6], pages(2), pages(12), "a")
    tree.evict_device(3)  # every node host-only now
    tree.match_prefix([5, 6], "a")  # a's [5, 6] is the most recent
    assert sorted(tree.evict_host_tenant("a", 1).tolist()) == [10]  # a's LRU, not b's older
    assert tree.host_pages_by_tenant == {"a": 1, "b": 1}
    tree.check_integrity()
    # Only a's pages, even when asked for more than a has.
    assert tree.evict_host_tenant("a", 5).tolist() == [12]
    assert tree.host_pages_by_tenant == {"b": 1}
    with pytest.raises(TreeError, match="no host quota"):
        tree.evict_host_tenant("b", 1)
    tree.check_integrity()


def test_tenant_eviction_skips_held_pages() -> None:
    tree = HiRadixTree(page_size=2, host_quotas={"a": 1})
    backed_up(tree, [1, 2], pages(0), pages(10), "a")
    tree.evict_device(1)
    node = tree.match_prefix([1, 2], "a").last_node
    tree.protect_host(node)  # an L3 call reads it
    assert len(tree.evict_host_tenant("a", 1)) == 0
    tree.unprotect_host(node)
    assert tree.evict_host_tenant("a", 1).tolist() == [10]
    tree.check_integrity()


def test_tenant_heap_survives_compaction() -> None:
    tree = HiRadixTree(page_size=1, host_quotas={"a": 100})
    for i in range(40):
        backed_up(tree, [1000 + i], pages(i), pages(100 + i), "a")
    tree.evict_device(40)
    for _ in range(60):  # touch every node many times: stale entries pile up
        for i in range(40):
            tree.match_prefix([1000 + i], "a")
            tree._push_candidate(tree.match_prefix([1000 + i], "a").last_node)
    tree.check_integrity()
    assert len(tree.evict_host_tenant("a", 40)) == 40
    tree.check_integrity()


def test_remove_tenant_deletes_every_unheld_node_of_that_tenant_only() -> None:
    tree = HiRadixTree(page_size=2)
    backed_up(tree, [1, 2, 3, 4], pages(0, 1), pages(10, 11), "a")
    tree.insert([1, 2, 3, 4, 5, 6], pages(0, 1, 2), "a")  # a device-only child
    tree.insert([1, 2, 3, 4], pages(3, 4), "b")
    tree.insert([9, 9], pages(5), None)
    removal = tree.remove_tenant("a")
    assert sorted(removal.device_pages.tolist()) == [0, 1, 2]
    assert sorted(removal.host_pages.tolist()) == [10, 11]
    assert (removal.kept_device_pages, removal.kept_host_pages) == (0, 0)
    assert tree.device_pages_by_tenant == {"b": 2, None: 1}
    assert tree.host_pages_by_tenant == {}
    assert tree.match_prefix([1, 2, 3, 4], "a").num_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4], "b").num_tokens == 4
    tree.check_integrity()
    again = tree.remove_tenant("a")  # idempotent
    assert len(again.device_pages) == len(again.host_pages) == len(again.nodes) == 0


def test_remove_tenant_keeps_what_a_request_holds() -> None:
    tree = HiRadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], pages(0, 1), "a")
    tree.insert([1, 2, 5, 6], pages(0, 2), "a")  # splits: [1,2] with children [3,4], [5,6]
    held = tree.match_prefix([1, 2, 3, 4], "a").last_node
    tree.lock(held)
    removal = tree.remove_tenant("a")
    assert removal.device_pages.tolist() == [2]  # the unheld branch only
    assert removal.kept_device_pages == 2  # [1,2] and [3,4] are held
    tree.check_integrity()
    tree.unlock(held)
    assert sorted(tree.remove_tenant("a").device_pages.tolist()) == [0, 1]
    assert tree.device_pages_by_tenant == {}
    assert tree.num_nodes == 0
    tree.check_integrity()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def device_stored(self, node: TreeNode) -> None:
        self.calls.append(("device_stored", node.id))

    def device_removed(self, node: TreeNode) -> None:
        assert node.parent is not None, "told before the node is unlinked"
        self.calls.append(("device_removed", node.id))

    def host_inserted(self, node: TreeNode) -> None:
        self.calls.append(("host_inserted", node.id))

    def host_removed(self, node: TreeNode) -> None:
        assert node.parent is not None, "told before the node is unlinked"
        self.calls.append(("host_removed", node.id))

    def pins_changed(self, node: TreeNode, pinned: bool) -> None:
        return None


def test_remove_tenant_tells_the_observer_of_each_tier() -> None:
    recorder = Recorder()
    tree = HiRadixTree(page_size=2, observer=recorder)
    node = backed_up(tree, [1, 2], pages(0), pages(10), "a")
    recorder.calls.clear()
    tree.remove_tenant("a")
    assert recorder.calls == [("device_removed", node.id), ("host_removed", node.id)]


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_the_tenant_counts_and_isolation(seed: int) -> None:
    """Inserts, backups, evictions of both tiers, tenant evictions and purges in a random
    order: the integrity check (per-tenant counts, tenant heaps) holds after each, a tenant
    eviction never takes another tenant's pages, a purge leaves none of the tenant's."""
    rng = np.random.default_rng(seed)
    tenants: list[str | None] = ["a", "b", None]
    tree = HiRadixTree(page_size=2, host_quotas={"a": 6, None: 4})
    next_page = [0]

    def fresh(n: int) -> np.ndarray:
        next_page[0] += n
        return np.arange(next_page[0] - n, next_page[0], dtype=np.int64)

    for _ in range(300):
        tenant = tenants[int(rng.integers(len(tenants)))]
        op = int(rng.integers(6))
        if op <= 1:  # a request: insert, and back up what can be
            tokens = [int(t) for t in rng.integers(0, 3, size=2 * int(rng.integers(1, 5)))]
            result = tree.insert(tokens, fresh(len(tokens) // 2), tenant)
            for node in result.backup_candidates:
                assert node.device_pages is not None
                tree.begin_backup(node, fresh(len(node.device_pages)))
                tree.finish_backup(node)
        elif op == 2:
            tree.evict_device(int(rng.integers(1, 6)))
        elif op == 3:
            tree.evict_host(int(rng.integers(1, 4)))
        elif op == 4 and tenant in ("a", None):
            others = {t: n for t, n in tree.host_pages_by_tenant.items() if t != tenant}
            tree.evict_host_tenant(tenant, int(rng.integers(1, 4)))
            assert {t: n for t, n in tree.host_pages_by_tenant.items() if t != tenant} == others
        elif op == 5 and rng.random() < 0.2:
            others_device = {t: n for t, n in tree.device_pages_by_tenant.items() if t != tenant}
            tree.remove_tenant(tenant)
            assert tenant not in tree.device_pages_by_tenant
            assert tenant not in tree.host_pages_by_tenant
            assert {t: n for t, n in tree.device_pages_by_tenant.items()
                    if t != tenant} == others_device
        tree.check_integrity()
