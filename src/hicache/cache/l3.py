"""The L3 tier as the cache drives it: prefetch (L3 -> L2) and backup (L2 -> L3).

Runs on the scheduler thread and never blocks on L3: lookups and data movement
happen on the StorageController's threads; this class turns their finished
operations into tree and allocator changes in ``poll()``.

Prefetch of a request:
1. ``start``: the local match ends at an anchor node; if L3 could add at least
   ``prefetch_threshold`` tokens, the anchor's path is made host-backed (so
   the continuation can hang from it), protected, and a lookup is queued.
2. lookup answered (poll): host pages are allocated for the pages found,
   within the in-flight budget, and a read is queued.
3. ``ready``/``finish`` (by the prefetch policy): the verified, continuous
   prefix that has landed goes into the tree as host pages (``insert_host``);
   pages not landed are freed once the io thread is done with them.

Backup: when a device->host copy lands, the node's pages are queued for L3
(keys = chained page keys; pages L3 already has are skipped); the host copy is
protected until the write finishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.radix.keys import chain_page_keys
from hicache.radix.node import TreeNode
from hicache.radix.results import no_pages
from hicache.storage.bandwidth import ReadTimeEstimate
from hicache.storage.base import StorageBackend
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.config import PrefetchPolicy, StorageConfig
from hicache.storage.controller import BackupOp, PrefetchOp, StorageController, StorageMetrics

if TYPE_CHECKING:
    from hicache.cache.hierarchical_cache import HierarchicalCache

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchHandle:
    """A request's prefetch, as the scheduler holds it (opaque to the engine)."""

    op: PrefetchOp
    data: bytes  # the request's tokens (packed), whole pages up to the prefetch end
    extra_key: str | None
    start_page: int  # pages matched locally when the prefetch started
    anchor: TreeNode  # host-protected end of the local match
    deadline: float | None  # timeout policy only
    num_requested_tokens: int  # tokens past the local match the prefetch asked L3 for
    in_controller: bool = True  # a lookup or read of this op is queued or running
    no_room: bool = False  # L3 had pages but no host pages could be given to them
    finished: bool = False
    num_inserted_tokens: int = 0
    abandoned: PageIds = field(default_factory=no_pages)  # freed when the read returns

    @property
    def num_found_tokens(self) -> int:
        """Tokens L3 holds for this request (-1 while the lookup runs)."""
        found = self.op.num_existing
        return found if found < 0 else found * (self.num_requested_tokens // len(self.op.keys))


class StorageTier:
    def __init__(
        self, cache: HierarchicalCache, config: StorageConfig, backend: StorageBackend
    ) -> None:
        assert cache.host_pool is not None
        self.cache = cache
        self.config = config
        self.backend = backend
        self.breaker = CircuitBreaker(
            config.breaker_failures, config.breaker_backoff_base, config.breaker_backoff_max,
            name=f"L3 ({backend.name})",
        )
        self.controller = StorageController(backend, self.breaker)
        self.controller.start()
        # Feeds the "auto" prefetch deadline; kept when a re-attach only updates policies.
        self.read_time = ReadTimeEstimate(cache.page_size)
        self._budget = max(1, int(cache.host_pool.num_pages * config.prefetch_max_host_fraction))
        self._in_flight_pages = 0
        self._handles: set[PrefetchHandle] = set()
        self._backups: dict[int, TreeNode] = {}

    @property
    def num_in_flight_prefetch_pages(self) -> int:
        return self._in_flight_pages

    @property
    def prefetch_budget_pages(self) -> int:
        return self._budget

    # ------------------------------------------------------------ prefetch
    def start(self, data: bytes, extra_key: str | None) -> PrefetchHandle | None:
        cache, tree = self.cache, self.cache.tree
        page_bytes = tree.page_bytes
        whole = len(data) // page_bytes
        match = tree.match_prefix(data, extra_key)
        start_page = match.num_tokens // cache.page_size
        missing_tokens = (whole - start_page) * cache.page_size
        if missing_tokens <= 0 or missing_tokens < self.config.prefetch_threshold:
            return None
        anchor = match.last_node
        if not self._make_host_backed(anchor):
            return None
        prev = tree.seed(extra_key) if anchor.is_root else tree.page_keys(anchor)[-1]
        keys = chain_page_keys(
            data[start_page * page_bytes : whole * page_bytes], cache.page_size, prev
        )
        tree.protect_host(anchor)
        deadline = None
        if self.config.prefetch_policy is PrefetchPolicy.TIMEOUT:
            deadline = time.monotonic() + self.config.prefetch_timeout(
                missing_tokens, self.read_time.allowance_per_ki_token_s()
            )
        handle = PrefetchHandle(
            op=PrefetchOp(keys), data=data[: whole * page_bytes], extra_key=extra_key,
            start_page=start_page, anchor=anchor, deadline=deadline,
            num_requested_tokens=missing_tokens,
        )
        handle.op.owner = handle
        self._handles.add(handle)
        self.controller.submit_query(handle.op)
        return handle

    def ready(self, handle: PrefetchHandle) -> bool:
        """May the request start now, under the prefetch policy?"""
        if handle.finished or self.config.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if handle.op.num_existing >= 0 and not handle.in_controller:
            return True  # complete: every page found has arrived (or could not be placed)
        if self.config.prefetch_policy is PrefetchPolicy.TIMEOUT:
            assert handle.deadline is not None
            return time.monotonic() >= handle.deadline
        return False

    def done(self, handle: PrefetchHandle) -> bool:
        """Nothing more will land in time: complete, or past the timeout policy's deadline.

        The same as ``ready`` but under best_effort, where a request may start
        before its pages land but one that queues anyway should keep fetching.
        """
        if self.config.prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            return self.ready(handle)
        return handle.finished or (handle.op.num_existing >= 0 and not handle.in_controller)

    def finish(self, handle: PrefetchHandle, keep: bool = True) -> int:
        """End the prefetch; with ``keep``, insert the continuous prefix that has landed.

        Returns the tokens inserted into the tree (as host pages).
        """
        if handle.finished:
            return handle.num_inserted_tokens
        handle.finished = True
        op = handle.op
        op.cancelled.set()  # the io thread stops after its current batch
        pages = op.host_pages if op.host_pages is not None else no_pages()
        # Pages below num_landed are final: the io thread only writes later ones.
        landed = op.num_landed if keep else 0
        if landed:
            tree = self.cache.tree
            end = (handle.start_page + landed) * tree.page_bytes
            result = tree.insert_host(
                handle.data[:end], pages[:landed], handle.start_page, handle.extra_key
            )
            self._free_host(result.duplicate_pages)
            self._in_flight_pages -= landed
            handle.num_inserted_tokens = landed * self.cache.page_size
            self.cache.stats.num_storage_hit_tokens += handle.num_inserted_tokens
        if handle.in_controller:
            handle.abandoned = pages[landed:]
        else:
            self._release_prefetch_pages(pages[landed:])
            self._handles.discard(handle)
        self.cache.tree.unprotect_host(handle.anchor)
        return handle.num_inserted_tokens

    # -------------------------------------------------------------- backup
    def backup(self, node: TreeNode) -> None:
        """``node``'s device->host copy has landed: queue its pages for L3."""
        assert node.host_pages is not None
        keys = self.cache.tree.page_keys(node)
        self.cache.tree.protect_host(node)
        self._backups[node.id] = node
        self.controller.submit_backup(BackupOp(list(keys), node.host_pages.copy(), node))

    # ---------------------------------------------------------------- poll
    def poll(self) -> None:
        for kind, op in self.controller.poll():
            if isinstance(op, BackupOp):
                node = op.owner
                assert isinstance(node, TreeNode)
                del self._backups[node.id]
                self.cache.tree.unprotect_host(node)
                self.cache.stats.num_storage_backed_up_pages += op.num_stored - op.num_existing
                continue
            handle = op.owner
            assert isinstance(handle, PrefetchHandle)
            handle.in_controller = False
            if kind == "queried":
                self._on_queried(handle)
                continue
            self.read_time.observe(op.num_landed, op.read_seconds)
            if handle.finished:  # a read whose request already moved on
                self._release_prefetch_pages(handle.abandoned)
                handle.abandoned = no_pages()
                self._handles.discard(handle)

    def _on_queried(self, handle: PrefetchHandle) -> None:
        op = handle.op
        if handle.finished:
            self._handles.discard(handle)
            return
        if op.cancelled.is_set() or not self.controller.running:
            return  # detaching: no new reads
        want = min(op.num_existing, self._budget - self._in_flight_pages)
        pages = self.cache.alloc_host(want) if want > 0 else no_pages()
        if len(pages) == 0:
            handle.no_room = op.num_existing > 0
            return
        op.host_pages = pages
        self._in_flight_pages += len(pages)
        handle.in_controller = True
        self.controller.submit_load(op)

    # ------------------------------------------------------------- helpers
    def _make_host_backed(self, anchor: TreeNode) -> bool:
        """Give every node root..anchor a host copy (issuing device->host copies)."""
        chain: list[TreeNode] = []
        node: TreeNode | None = anchor
        while node is not None and not node.is_root and node.host_pages is None:
            chain.append(node)
            node = node.parent
        return all(self.cache.backup_node(item) for item in reversed(chain))

    def _release_prefetch_pages(self, pages: PageIds) -> None:
        self._in_flight_pages -= len(pages)
        self._free_host(pages)

    def _free_host(self, pages: PageIds) -> None:
        if len(pages):
            host = self.cache.host_pool
            assert host is not None
            host.allocator.free(pages)

    # -------------------------------------------------------------- detach
    def close(self) -> None:
        """Drain: finish in-flight calls, cancel queued ones, settle every page and node."""
        for handle in self._handles:
            handle.op.cancelled.set()
        self.controller.stop()
        self.poll()
        for handle in list(self._handles):
            self.finish(handle)
        assert not self._handles and not self._backups, "L3 operations left unsettled"
        self.backend.close()

    def metrics(self) -> StorageMetrics:
        return self.controller.snapshot()

    @property
    def prefetch_timeout_per_ki_token_s(self) -> float:
        """The timeout policy's seconds per 1024 tokens in force (configured or observed)."""
        return self.config.per_ki_token_s(self.read_time.allowance_per_ki_token_s())

    def held_host_pages(self) -> PageIds:
        """Host pages owned by prefetches (not yet in the tree): for integrity checks."""
        parts = []
        for handle in self._handles:
            pages = handle.op.host_pages
            if handle.finished:
                parts.append(handle.abandoned)
            elif pages is not None:
                parts.append(pages)
        return np.concatenate(parts) if parts else no_pages()
