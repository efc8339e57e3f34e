"""The host tier's core set: loops larger than the tier still hit, and it follows a
workload that moves on (HiRadixTree's ``core_pages``)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.config import WritePolicy
from hicache.memory.allocator import PageAllocator
from hicache.radix.tree import HiRadixTree

PAGE = 2
DEVICE_PAGES = 24
HOST_PAGES = 40
TURN = 2  # pages a turn adds to a conversation


class Worker:
    """One worker's tree and pools under write_through, every step synchronous: match,
    load the host part back, compute the rest, insert, back the new pages up."""

    def __init__(self, core_pages: int | None) -> None:
        self.tree = HiRadixTree(PAGE, WritePolicy.WRITE_THROUGH, core_pages=core_pages)
        self.device = PageAllocator(DEVICE_PAGES, "device")
        self.host = PageAllocator(HOST_PAGES, "host")

    def serve(self, tokens: list[int]) -> int:
        """Serve one prompt; returns how many of its pages came from the cache."""
        tree = self.tree
        match = tree.match_prefix(tokens, use=True)
        reused = len(match.device_pages) + len(match.host_pages)
        tree.lock(match.last_node)
        host_nodes = tree.host_path(match)
        new = len(tokens) // PAGE - reused
        self._device_room(len(match.host_pages) + new)
        pages = list(match.device_pages)
        for node in host_nodes:  # load-back
            assert node.host_pages is not None
            loaded = self.device.allocate(len(node.host_pages))
            tree.set_device_pages(node, loaded)
            pages.extend(loaded)
        pages.extend(self.device.allocate(new))
        result = tree.insert(tokens, np.array(pages, np.int64))
        self.device.free(result.duplicate_pages)
        tree.unlock(match.last_node)
        for node in result.backup_candidates:
            assert node.device_pages is not None
            need = len(node.device_pages)
            if not self.host.can_allocate(need):
                short = need - self.host.num_free_pages
                self.host.free(tree.evict_host(short, include_core=tree.joins_core(node)))
            if not self.host.can_allocate(need):
                break  # the rest hang below this one
            tree.begin_backup(node, self.host.allocate(need))
            tree.finish_backup(node)
        tree.check_integrity()
        return reused

    def _device_room(self, num_pages: int) -> None:
        while not self.device.can_allocate(num_pages):
            eviction = self.tree.evict_device(num_pages - self.device.num_free_pages)
            assert len(eviction.freed_pages), "the device cannot hold one request"
            self.device.free(eviction.freed_pages)


def conversation(index: int, rounds: int, shared: int = 2) -> list[int]:
    """A conversation's prompt at ``rounds`` turns: a prefix every conversation shares
    (``shared`` pages), then TURN pages a turn of its own."""
    system = [7] * (shared * PAGE)
    own = [1000 * (index + 1) + t for t in range(TURN * PAGE * rounds)]
    return system + own


SHARED_HITS = 5 * 2  # each of five turns a round finds the 2 shared pages


def loop_reuse(core_pages: int | None, conversations: int, rounds: int) -> list[int]:
    """Pages reused in each round of conversations taking turns in a fixed order."""
    worker = Worker(core_pages)
    per_round = []
    for r in range(1, rounds + 1):
        per_round.append(sum(worker.serve(conversation(c, r)) for c in range(conversations)))
    return per_round


def test_lru_under_a_loop_larger_than_the_host_tier_never_hits() -> None:
    # Five conversations of 2 more pages a turn: from round 6 on (5 x 12 = 60 pages of
    # their own against 40) each turn evicts exactly the conversation that comes next.
    reuse = loop_reuse(None, conversations=5, rounds=10)
    assert reuse[5:] == [SHARED_HITS] * 5


@pytest.mark.parametrize("core_pages", [20, 30, 36])
def test_the_core_set_keeps_part_of_the_loop_cached(core_pages: int) -> None:
    reuse = loop_reuse(core_pages, conversations=5, rounds=10)
    # Once the core set is full, every page of it hits every round: the shared prefix
    # (2 of its pages) and core_pages - 2 pages of the conversations' own history.
    assert reuse[5:] == [SHARED_HITS + core_pages - 2] * 5, reuse


def moved_on_misses(core_pages: int | None) -> tuple[list[int], Worker]:
    """A loop fills the host tier, then two new conversations take turns, each turn
    followed by three prompts nobody sends again, which push it out of the device and
    out of the host pages outside the core set before it comes back. Returns the pages
    each of their turns computed."""
    worker = Worker(core_pages)
    for r in range(1, 7):
        for c in range(5):
            worker.serve(conversation(c, r))
    misses = []
    one_off = 0
    for r in range(1, 9):
        for c in (10, 11):
            tokens = conversation(c, r)
            misses.append(len(tokens) // PAGE - worker.serve(tokens))
            for _ in range(3):
                one_off += 1
                worker.serve([100_000 * one_off + t for t in range(8 * PAGE)])
    return misses, worker


def test_lru_under_prompts_used_once_keeps_no_conversation() -> None:
    misses, _ = moved_on_misses(None)
    assert misses[-2:] == [TURN * 8] * 2  # the whole conversation, every turn


@pytest.mark.parametrize("core_pages", [30, 36])
def test_the_core_set_follows_a_workload_that_moves_on(core_pages: int) -> None:
    misses, worker = moved_on_misses(core_pages)
    assert worker.tree.num_core_pages == core_pages
    # A turn that comes back computed again has its pages' history (kept after they
    # left the tree): it came back sooner than the loop's pages were last used, so it
    # joins the core set and hits from then on. Only the newest turn is outside it:
    # a turn computes its own pages and at most the previous turn's.
    assert misses[:2] == [TURN] * 2  # all new but the shared prefix
    assert max(misses[2:]) <= 2 * TURN, misses
    assert sum(misses) <= 1.5 * TURN * len(misses), misses
    core_nodes = [n for n in worker.tree.iter_nodes() if n.core]
    fresh_core = sum(
        len(n.tokens) // (4 * PAGE) for n in core_nodes
        if 11_000 <= int(np.frombuffer(n.tokens, "<i4")[0]) < 13_000
    )
    assert fresh_core >= 2 * TURN * 6  # the two conversations' history is core now


def test_a_core_set_of_zero_is_least_recently_used() -> None:
    assert loop_reuse(0, conversations=5, rounds=10) == loop_reuse(None, 5, 10)


def test_a_lookup_is_not_a_use() -> None:
    tree = HiRadixTree(PAGE, WritePolicy.WRITE_THROUGH, core_pages=2)
    nodes = {}
    for i, tokens in enumerate(([1, 2], [3, 4], [5, 6])):
        node = tree.insert(tokens, np.array([i], np.int64)).last_node
        tree.begin_backup(node, np.array([i], np.int64))
        tree.finish_backup(node)
        nodes[tokens[0]] = node
    assert [nodes[k].core for k in (1, 3, 5)] == [True, True, False]  # room for two
    tree.match_prefix([1, 2], use=True)
    tree.match_prefix([3, 4], use=True)
    # The third prefix is looked up (its request waits, or a prefetch asks), then used:
    # its previous use is still its insert, older than both core pages' last access, so
    # it stays out.
    tree.match_prefix([5, 6])
    tree.match_prefix([5, 6], use=True)
    assert not nodes[5].core
    # Used again now, its previous use is more recent than the core set's oldest
    # access: it joins, and pushes the least recently accessed core page out.
    tree.match_prefix([5, 6], use=True)
    assert [nodes[k].core for k in (1, 3, 5)] == [False, True, True]
    tree.check_integrity()
