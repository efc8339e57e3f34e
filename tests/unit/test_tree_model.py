"""HiRadixTree against a reference model of cached prefixes (hypothesis state machine).

Each page slot carries fake KV "content": the token prefix it holds the KV of.
Copies between tiers copy content, so a page mix-up anywhere (splits, demotion,
load-back, backup, eviction) shows up as a match returning wrong content.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.config import WritePolicy
from hicache.memory.allocator import PageAllocator
from hicache.radix.node import TreeNode
from hicache.radix.tree import HiRadixTree

PAGE = 2
DEVICE_PAGES = 24
HOST_PAGES = 40

Prefix = tuple[int, ...]

# Small alphabet and short sequences so prefixes are shared often.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=14).map(tuple)


class TreeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = WritePolicy.WRITE_THROUGH
        self.tree = HiRadixTree(PAGE, self.policy)
        self.dev_alloc = PageAllocator(DEVICE_PAGES, "device")
        self.host_alloc = PageAllocator(HOST_PAGES, "host")
        self.dev_content: list[Prefix | None] = [None] * DEVICE_PAGES
        self.host_content: list[Prefix | None] = [None] * HOST_PAGES
        self.locks: list[tuple[TreeNode, Prefix]] = []
        self.writing: list[TreeNode] = []
        self.protected: list[tuple[TreeNode, Prefix]] = []

    @rule(
        policy=st.sampled_from(list(WritePolicy)),
        core_pages=st.sampled_from([None, 0, 6, HOST_PAGES // 2, HOST_PAGES]),
    )
    @precondition(lambda self: self.tree.num_nodes == 0)
    def choose_policy(self, policy: WritePolicy, core_pages: int | None) -> None:
        """A write policy and a host core set (none; empty; smaller than one request;
        half the host tier; all of it)."""
        self.policy = policy
        self.tree = HiRadixTree(PAGE, policy, core_pages=core_pages)

    # ---------------------------------------------------------------- helpers
    def page_prefixes(self, seq: Prefix) -> list[Prefix]:
        full = len(seq) - len(seq) % PAGE
        return [seq[: i + PAGE] for i in range(0, full, PAGE)]

    def make_room(self, num_pages: int) -> bool:
        """Evict device pages until num_pages are free (backing up under write_back)."""
        for _ in range(50):
            if self.dev_alloc.can_allocate(num_pages):
                return True
            ev = self.tree.evict_device(num_pages - self.dev_alloc.num_free_pages)
            self.free_device(ev.freed_pages)
            if ev.pending_write_back:
                for node in ev.pending_write_back:
                    if not self.backup(node, sync=True):
                        break
            elif len(ev.freed_pages) == 0:
                return False
        return self.dev_alloc.can_allocate(num_pages)

    def free_device(self, pages: np.ndarray) -> None:
        for p in pages:
            self.dev_content[p] = None
        self.dev_alloc.free(pages)

    def host_room(self, num_pages: int) -> bool:
        if not self.host_alloc.can_allocate(num_pages):
            freed = self.tree.evict_host(num_pages - self.host_alloc.num_free_pages)
            for p in freed:
                self.host_content[p] = None
            self.host_alloc.free(freed)
        return self.host_alloc.can_allocate(num_pages)

    def backup(self, node: TreeNode, sync: bool) -> bool:
        assert node.device_pages is not None
        if not self.host_room(len(node.device_pages)):
            return False
        host = self.host_alloc.allocate(len(node.device_pages))
        self.tree.begin_backup(node, host)
        for d, h in zip(node.device_pages, host, strict=True):
            self.host_content[h] = self.dev_content[d]
        if sync:
            self.tree.finish_backup(node)
        else:
            self.writing.append(node)
        return True

    # ------------------------------------------------------------------ rules
    @rule(seq=sequences, hold=st.booleans(), reuse=st.sampled_from(["all", "device", "none"]))
    def serve_request(self, seq: Prefix, hold: bool, reuse: str) -> None:
        """What a request does: match, lock, load host part, compute the rest, insert.

        reuse="device" recomputes the host part (a hit too small to load), so
        insert must adopt the new pages; reuse="none" recomputes everything (a
        request that matched before another one inserted the same prefix), so
        insert must hand back duplicates.
        """
        prefixes = self.page_prefixes(seq)
        if not prefixes:
            return
        match = self.tree.match_prefix(list(seq))
        self.tree.lock(match.last_node)
        pages = list(match.device_pages) if reuse != "none" else []
        host_nodes = self.tree.host_path(match) if reuse == "all" else []
        need = sum(len(n.tokens) // (4 * PAGE) for n in host_nodes)
        new = len(prefixes) - len(pages) - need
        if not self.make_room(need + new):
            self.tree.unlock(match.last_node)
            return
        for node in host_nodes:  # load-back
            assert node.host_pages is not None
            dev = self.dev_alloc.allocate(len(node.host_pages))
            for d, h in zip(dev, node.host_pages, strict=True):
                self.dev_content[d] = self.host_content[h]
            self.tree.set_device_pages(node, dev)
            pages.extend(dev)
        computed = self.dev_alloc.allocate(new)
        for i, d in enumerate(computed):
            self.dev_content[d] = prefixes[len(pages) + i]
        pages.extend(computed)
        result = self.tree.insert(list(seq[: len(prefixes) * PAGE]), np.array(pages, np.int64))
        self.free_device(result.duplicate_pages)
        self.tree.unlock(match.last_node)
        for node in result.backup_candidates:
            if not self.backup(node, sync=False):
                break  # the rest hang below this one: contiguity forbids them
        if hold:
            self.tree.lock(result.last_node)
            self.locks.append((result.last_node, seq[: len(prefixes) * PAGE]))

    @rule(seq=sequences)
    def match_checks_content(self, seq: Prefix) -> None:
        match = self.tree.match_prefix(list(seq))
        prefixes = self.page_prefixes(seq)
        got = [self.dev_content[p] for p in match.device_pages]
        got += [self.host_content[p] for p in match.host_pages]
        assert got == prefixes[: len(got)], "a page holds the KV of another prefix"
        # The match is maximal: the next page prefix is cached in no tier.
        if len(got) < len(prefixes):
            present = {self.dev_content[p] for p in self.tree.device_page_ids()}
            present |= {self.host_content[p] for p in self.tree.host_page_ids()}
            assert prefixes[len(got)] not in present, "match stopped short of a cached page"

    @rule(seq=sequences)
    def peek_measures_the_match_and_changes_nothing(self, seq: Prefix) -> None:
        def state() -> list[tuple[int, int, int]]:
            return [(n.id, n.last_access, len(n.tokens)) for n in self.tree.iter_nodes()]

        before = state()
        peek = self.tree.peek_prefix(list(seq))
        assert state() == before, "peek split a node or touched the LRU order"
        match = self.tree.match_prefix(list(seq))
        assert peek.num_device_tokens == match.num_device_tokens
        assert peek.num_host_tokens == match.num_host_tokens
        # Locking the device part protects exactly the pages peek called unlocked.
        protected = self.tree.num_protected_device_pages
        self.tree.lock(match.last_device_node)
        assert self.tree.num_protected_device_pages - protected == peek.num_unlocked_device_pages
        self.tree.unlock(match.last_device_node)

    @rule(k=st.integers(1, DEVICE_PAGES))
    def evict_device(self, k: int) -> None:
        locked = {p for _, s in self.locks for p in self.page_prefixes(s)}
        ev = self.tree.evict_device(k)
        for p in ev.freed_pages:
            assert self.dev_content[p] not in locked, "evicted a locked prefix"
        self.free_device(ev.freed_pages)
        for node in ev.pending_write_back:
            self.backup(node, sync=True)

    @rule(k=st.integers(1, HOST_PAGES))
    def evict_host(self, k: int) -> None:
        freed = self.tree.evict_host(k)
        locked = {p for _, s in self.locks + self.protected for p in self.page_prefixes(s)}
        for p in freed:
            assert self.host_content[p] not in locked
            self.host_content[p] = None
        self.host_alloc.free(freed)

    @rule(seq=sequences)
    def protect_host(self, seq: Prefix) -> None:
        match = self.tree.match_prefix(list(seq))
        node = match.last_node
        if node is not self.tree.root and node.host_pages is not None:
            self.tree.protect_host(node)
            self.protected.append((node, seq[: match.num_tokens]))

    @rule(data=st.data())
    @precondition(lambda self: bool(self.protected))
    def unprotect_host(self, data: st.DataObject) -> None:
        node, _ = self.protected.pop(data.draw(st.integers(0, len(self.protected) - 1)))
        self.tree.unprotect_host(node)

    @rule()
    @precondition(lambda self: bool(self.writing))
    def ack_writes(self) -> None:
        for node in self.writing:
            self.tree.finish_backup(node)
        self.writing.clear()

    @rule(data=st.data())
    @precondition(lambda self: bool(self.locks))
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.tree.unlock(node)

    # ------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.tree.check_integrity()
        self.dev_alloc.check_integrity()
        self.host_alloc.check_integrity()
        tree_dev = set(self.tree.device_page_ids().tolist())
        tree_host = set(self.tree.host_page_ids().tolist())
        # Every allocated page belongs to the tree: no leak, no page owned twice.
        assert tree_dev == {p for p in range(DEVICE_PAGES) if self.dev_alloc.is_allocated(p)}
        assert tree_host == {p for p in range(HOST_PAGES) if self.host_alloc.is_allocated(p)}
        for node, seq in self.locks:
            assert node.device_pages is not None or node.host_pages is not None
            match = self.tree.match_prefix(list(seq))
            assert match.num_tokens == len(seq), "a locked prefix was lost"
        for node, seq in self.protected:
            assert node.host_pages is not None, "a protected node lost its host copy"
            got = self.tree.match_prefix(list(seq))
            assert got.num_tokens == len(seq), "a protected host prefix was lost"


TreeModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTreeModel = TreeModel.TestCase
