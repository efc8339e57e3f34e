"""The L3 tier as the cache drives it: prefetch (L3 -> L2) and backup (L2 -> L3).

Runs on the scheduler thread and never blocks on L3: lookups and data movement
happen on the StorageController's threads; this class turns their finished
operations into tree and allocator changes in ``poll()``. It reaches the cache only
through the ``L3Context`` the cache gives it (``cache/l3_context.py``).

Prefetch of a request:
1. ``start``: the local match ends at an anchor node; if L3 could add at least
   ``prefetch_threshold`` tokens, the anchor's path is made host-backed (so
   the continuation can hang from it), protected, and a lookup is queued.
2. lookup answered (poll): host pages are allocated for the pages found,
   within the in-flight budget, and a read is queued.
3. ``ready``/``finish`` (by the prefetch policy; ``wait_complete`` waits at
   most ``prefetch_timeout_max``): the verified, continuous prefix that has
   landed goes into the tree as host pages (``insert_host``); pages no ``get``
   can touch any more are freed at once, those of the batch being read when
   the read thread is done with it.

Backup: when a device->host copy lands, the node's pages are queued for L3
(keys = chained page keys; pages L3 already has are skipped); the host copy is
protected until the write finishes. A cache that does not write to L3
(``writes_to_l3``: an MLA rank other than 0, whose pages rank 0 writes) marks
its backups done at once.

Stalled calls (past the controller's deadline, still running): a stalled
``get`` may write its host pages whenever it returns, so they are quarantined
(neither freed nor given to the tree) until it does; a stalled ``set`` reads
its node's host pages, so the node stays protected until it returns (and if
the tree is flushed meanwhile, the pages stay reserved). Handing such a page
out earlier would let a late write corrupt another prefix's KV, or let the
store save another prefix's bytes under this key with a matching checksum.

Under tensor parallelism (``context.replicated()``) every decision that changes the
tree or the host allocator is taken from the values the ranks agreed: the tier's
``agreement`` (``cache/l3_agreement.py``) holds that bookkeeping, and the few places
below that would act on a rank-local value (a lookup answered, a prefetch complete or
past its deadline, how much it keeps, when its unkept pages and a stalled read's pages
are freed, a backup finished, when the pages of a backup whose node a flush dropped are
freed) hand the decision to it when ``handle.replicated`` (or ``context.replicated()`` for
backups). A detached tier goes on with that until nothing of it awaits agreement
(``settled``). Alone (tp 1) the local values are used as they come.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.cache.l3_agreement import L3Agreement, SlotProgress
from hicache.memory.allocator import PageIds
from hicache.radix.keys import chain_page_keys
from hicache.radix.node import TreeNode
from hicache.radix.results import no_pages
from hicache.storage.bandwidth import ReadTimeEstimate
from hicache.storage.base import StorageBackend
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.config import PrefetchPolicy, StorageConfig
from hicache.storage.controller import (
    BackupOp,
    DiscardOp,
    PrefetchOp,
    StalledCall,
    StorageController,
    StorageMetrics,
)

if TYPE_CHECKING:
    from hicache.cache.l3_context import L3Context

logger = logging.getLogger(__name__)

# Deadline of an L3 clear: one call for the whole store (a file per page, say), which may
# take longer than a batch call's io_timeout_s.
CLEAR_TIMEOUT_S = 60.0


@dataclass(eq=False)
class PrefetchHandle:
    """A request's prefetch, as the scheduler holds it (opaque to the engine)."""

    op: PrefetchOp
    data: bytes  # the request's tokens (packed), whole pages up to the prefetch end
    extra_key: str | None
    start_page: int  # pages matched locally when the prefetch started
    anchor: TreeNode  # host-protected end of the local match
    deadline: float  # the request starts by then (timeout and wait_complete policies)
    num_requested_tokens: int  # tokens past the local match the prefetch asked L3 for
    in_controller: bool = True  # a lookup or read of this op is queued or running
    replicated: bool = False  # under tensor parallelism: decide on agreed values
    no_room: bool = False  # L3 had pages but no host pages could be given to them
    finished: bool = False
    lookup_awaited: bool = False  # the scheduler waited for its lookup once (await_lookup)
    num_inserted_tokens: int = 0
    # Pages of op.host_pages the handle no longer owns: [0, num_kept_pages) went to
    # the tree, [num_released_from:] were freed, ``quarantined`` belong to stalled gets.
    num_kept_pages: int = 0
    num_released_from: int | None = None
    quarantined: PageIds = field(default_factory=no_pages)
    # Under tensor parallelism: the values the ranks last agreed (None: none yet).
    agreed: SlotProgress | None = None

    def owned_pages(self) -> PageIds:
        """Host pages this prefetch holds and must free (or give to the tree)."""
        pages = self.op.host_pages
        if pages is None:
            return no_pages()
        owned = pages[self.num_kept_pages : self.num_released_from]
        if len(self.quarantined):
            owned = owned[~np.isin(owned, self.quarantined)]
        return owned

    @property
    def num_found_tokens(self) -> int:
        """Tokens L3 holds for this request (-1 while the lookup runs)."""
        found = self.op.num_existing
        if self.replicated:
            agreed = self.agreed
            found = agreed.num_found_pages if agreed is not None and agreed.queried else -1
        return found if found < 0 else found * (self.num_requested_tokens // len(self.op.keys))


class StorageTier:
    def __init__(
        self, context: L3Context, config: StorageConfig, backend: StorageBackend
    ) -> None:
        # All this tier sees and changes of the cache it serves.
        self._context = context
        self.backend = backend
        self.breaker = CircuitBreaker(
            config.breaker_failures, config.breaker_backoff_base, config.breaker_backoff_max,
            name=f"L3 ({backend.name})",
        )
        self.controller = StorageController(backend, self.breaker, config.io_timeout_s)
        self._config = config
        self.controller.start()
        # Feeds the "auto" prefetch deadline and, from the same samples, the cost model's
        # read latency and bandwidth; kept when a re-attach only updates policies.
        self.read_time = ReadTimeEstimate(context.page_size, page_bytes=context.host_page_bytes)
        self._budget = max(1, int(context.host_num_pages * config.prefetch_max_host_fraction))
        # Prefetch pages, quarantined ones included: host memory held for L3 reads.
        self._in_flight_pages = 0
        self._handles: set[PrefetchHandle] = set()
        self._backups: dict[int, TreeNode] = {}
        # Under tensor parallelism: what the ranks agree on, and when (inert alone).
        self.agreement = L3Agreement(self)
        # Stalled calls and what they keep: prefetch pages under a get (counted in
        # flight), nodes under a set, and pages under a set whose tree was flushed.
        self._quarantine: dict[StalledCall, PageIds] = {}
        self._stalled_backups: dict[StalledCall, TreeNode] = {}
        self._orphaned: dict[StalledCall, PageIds] = {}
        self._closing = False
        self._backend_closed = False

    @property
    def config(self) -> StorageConfig:
        return self._config

    @config.setter
    def config(self, config: StorageConfig) -> None:
        """Re-attaching the same store updates the policies and the call deadline."""
        self._config = config
        self.controller.io_timeout_s = config.io_timeout_s

    @property
    def num_in_flight_prefetch_pages(self) -> int:
        return self._in_flight_pages

    @property
    def prefetch_budget_pages(self) -> int:
        return self._budget

    @property
    def num_quarantined_pages(self) -> int:
        """Host pages reserved for stalled calls, or for backups whose node a flush dropped
        while the ranks had not agreed they finished (not in the tree, not free)."""
        reserved = (*self._quarantine.values(), *self._orphaned.values(),
                    *self.agreement.orphaned_pages())
        return sum(len(p) for p in reserved)

    # ------------------------------------------------------------ prefetch
    def start(self, data: bytes, extra_key: str | None) -> PrefetchHandle | None:
        context = self._context
        tree = context.tree()
        if context.replicated() and not self.agreement.slot_free:
            return None
        page_bytes = tree.page_bytes
        whole = len(data) // page_bytes
        match = tree.match_prefix(data, extra_key)
        start_page = match.num_tokens // context.page_size
        missing_tokens = (whole - start_page) * context.page_size
        if missing_tokens <= 0 or missing_tokens < self.config.prefetch_threshold:
            return None
        anchor = match.last_node
        if not self._make_host_backed(anchor):
            return None
        prev = tree.seed(extra_key) if anchor.is_root else tree.page_keys(anchor)[-1]
        keys = chain_page_keys(
            data[start_page * page_bytes : whole * page_bytes], context.page_size, prev
        )
        tree.protect_host(anchor)
        # wait_complete is bounded too: a store that never completes must not hold the request.
        if self.config.prefetch_policy is PrefetchPolicy.TIMEOUT:
            wait_s = self.config.prefetch_timeout(
                missing_tokens, self.read_time.allowance_per_ki_token_s()
            )
        else:
            wait_s = self.config.prefetch_timeout_max
        deadline = context.clock() + wait_s
        handle = PrefetchHandle(
            op=PrefetchOp(keys, tenant=extra_key), data=data[: whole * page_bytes],
            extra_key=extra_key,
            start_page=start_page, anchor=anchor, deadline=deadline,
            num_requested_tokens=missing_tokens, replicated=context.replicated(),
        )
        handle.op.owner = handle
        self._handles.add(handle)
        if handle.replicated:
            self.agreement.add_prefetch(handle)
        self.controller.submit_query(handle.op)
        return handle

    def _complete(self, handle: PrefetchHandle) -> bool:
        """Every page found has arrived (or could not be placed): on every rank if agreed."""
        if handle.replicated:
            return self.agreement.complete(handle)
        return handle.op.num_existing >= 0 and not handle.in_controller

    def _past_deadline(self, handle: PrefetchHandle) -> bool:
        if handle.replicated:
            return self.agreement.past_deadline(handle)
        return self._context.clock() >= handle.deadline

    def await_lookup(self, handle: PrefetchHandle, timeout_s: float) -> bool:
        """Wait up to ``timeout_s``, once per prefetch, for its lookup, and apply the answer
        (``poll``); True when it came. A request whose lookup has not answered cannot start
        (the pages L3 may hold are worth waiting for), so a lookup posted this tick would
        otherwise cost it a whole forward of the requests running beside it. Not under
        tensor parallelism: every rank's answer is agreed at the tick."""
        if handle.replicated or handle.lookup_awaited or handle.op.host_pages is not None \
                or not handle.in_controller:
            return False
        handle.lookup_awaited = True
        if not self.controller.wait_queried(handle.op, timeout_s):
            return False
        self.poll()
        return True

    def await_read(self, handle: PrefetchHandle, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for its read to end, and apply it (``poll``); True when
        it ended. Not waited for when the live read time (``read_time``) says the pages
        still to come take longer than that: the wait would only cost the requests
        running beside it. Not under tensor parallelism (every rank's progress is agreed
        at the tick), nor before the lookup answered (``await_lookup``)."""
        op = handle.op
        if handle.replicated or not handle.in_controller or op.host_pages is None \
                or timeout_s <= 0:
            return False
        predicted = self.read_time.predict_read(max(0, len(op.host_pages) - op.num_landed))
        if predicted is not None and predicted > timeout_s:
            return False
        if not self.controller.wait_read(op, timeout_s):
            return False
        self.poll()
        return True

    def ready(self, handle: PrefetchHandle) -> bool:
        """May the request start now, under the prefetch policy?"""
        if handle.finished or self.config.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if self._complete(handle):
            return True
        if not self._past_deadline(handle):
            return False
        if self.config.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
            logger.debug(
                "L3 prefetch incomplete after prefetch_timeout_max=%.1f s: the request goes on",
                self.config.prefetch_timeout_max,
            )
        return True

    def done(self, handle: PrefetchHandle) -> bool:
        """Nothing more will land in time: complete, or past the timeout policy's deadline.

        The same as ``ready`` but under best_effort, where a request may start
        before its pages land but one that queues anyway should keep fetching.
        """
        if self.config.prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            return self.ready(handle)
        return handle.finished or self._complete(handle)

    def num_landed_tokens(self, handle: PrefetchHandle) -> int:
        """Tokens of the prefetch on the host by now, in order (what ``finish`` would keep;
        under tensor parallelism what every rank has)."""
        if handle.finished:
            return handle.num_inserted_tokens
        landed = handle.op.num_landed
        if handle.replicated:
            landed = min(landed, self.agreement.num_landed_pages(handle))
        return landed * self._context.page_size

    def finish(self, handle: PrefetchHandle, keep: bool = True) -> int:
        """End the prefetch; with ``keep``, insert the continuous prefix that has landed.

        Returns the tokens inserted into the tree (as host pages).
        """
        if handle.finished:
            return handle.num_inserted_tokens
        handle.finished = True
        op = handle.op
        # The read thread stops before its next batch; a get may still write pages
        # below ``claimed``, never those past it.
        claimed = op.cancel()
        pages = op.host_pages if op.host_pages is not None else no_pages()
        # Pages below num_landed are final: the read thread only writes later ones.
        landed = op.num_landed if keep else 0
        if handle.replicated:
            landed = min(landed, self.agreement.num_landed_pages(handle))
        if landed:
            tree = self._context.tree()
            end = (handle.start_page + landed) * tree.page_bytes
            result = tree.insert_host(
                handle.data[:end], pages[:landed], handle.start_page, handle.extra_key
            )
            self._free_host(result.duplicate_pages)
            self._in_flight_pages -= landed
            handle.num_kept_pages = landed
            handle.num_inserted_tokens = landed * self._context.page_size
            self._context.stats.num_storage_hit_tokens += handle.num_inserted_tokens
        # Under tensor parallelism the rest is freed once every rank's I/O for it has
        # returned (the agreement), the same tick everywhere: freeing it when this rank's
        # read ends would leave the ranks different free host pages, so different evictions.
        if not handle.replicated:
            self._release_unkept(handle, claimed)
        self._context.tree().unprotect_host(handle.anchor)
        return handle.num_inserted_tokens

    def _release_unkept(self, handle: PrefetchHandle, claimed: int) -> None:
        """Free the pages of a finished prefetch that did not join the tree: now what no
        get can touch, the batch a get is reading when its read ends."""
        if handle.in_controller:
            release_from = max(claimed, handle.num_kept_pages)
            pages = handle.op.host_pages if handle.op.host_pages is not None else no_pages()
            self._release_prefetch_pages(pages[release_from:])
            handle.num_released_from = release_from
        else:
            self.release_prefetch(handle)

    def release_prefetch(self, handle: PrefetchHandle) -> None:
        """Forget a settled prefetch whose I/O has returned, freeing the pages it holds."""
        self._release_owned(handle)
        self._handles.discard(handle)

    # -------------------------------------------------------------- backup
    def backup(self, node: TreeNode) -> None:
        """``node``'s device->host copy has landed: queue its pages for L3."""
        assert node.host_pages is not None
        keys = self._context.tree().page_keys(node)
        self._context.tree().protect_host(node)
        self._backups[node.id] = node
        if self._context.events is not None:
            self._context.events.l3_put_issued(node)
        op = BackupOp(list(keys), node.host_pages.copy(), node, tenant=node.extra_key)
        if self._context.replicated():
            self.agreement.add_backup(op)
        if not self._context.writes_to_l3:
            # Another rank writes these pages (MLA under TP: rank 0); for this one the
            # backup is done now, and agreed like any other.
            if self._context.replicated():
                self.agreement.backup_finished(op)
            else:
                self.settle_backup(op)
            return
        self.controller.submit_backup(op)

    def backing_up(self, node: TreeNode) -> bool:
        """Is a write of ``node``'s pages to L3 queued or running?"""
        return node.id in self._backups

    def discard(self, keys: list[bytes]) -> None:
        """Drop ``keys`` from L3 (pages the cache found damaged), on the write thread."""
        self.controller.submit_discard(DiscardOp(list(keys)))

    # ---------------------------------------------------------------- poll
    def poll(self) -> None:
        for kind, op in self.controller.poll():
            if isinstance(op, DiscardOp):
                continue
            if isinstance(op, StalledCall):
                if kind == "stalled":
                    self._on_stalled(op)
                else:
                    self._on_returned(op)
                continue
            if isinstance(op, BackupOp):
                if self._context.replicated():  # under TP: acknowledged when agreed
                    stalled = any(call.op is op for call in self._stalled_backups)
                    self.agreement.backup_finished(op, stalled)
                else:
                    self.settle_backup(op)
                continue
            handle = op.owner
            assert isinstance(handle, PrefetchHandle)
            handle.in_controller = False
            if kind == "queried":
                self._on_queried(handle)
                continue
            if op.host_pages is not None and op.num_landed == len(op.host_pages):
                # Whole reads only: a cut-short one (stalled, cancelled) says nothing of speed.
                self.read_time.observe(op.num_landed, op.read_seconds)
            if handle.finished and not handle.replicated:  # its request moved on
                self.release_prefetch(handle)
        if self._closing:
            self._close_backend_when_idle()

    def settle_backup(self, op: BackupOp, orphan: bool = False) -> None:
        """A finished backup releases its node (alone: when it finishes; under tensor
        parallelism: once every rank finished it). ``orphan``: a flush dropped its node
        meanwhile, so its host pages, kept until now, are freed."""
        self._context.stats.num_storage_backed_up_pages += op.num_stored - op.num_existing
        if orphan:
            self._free_host(op.host_pages)
            return
        node = op.owner
        assert isinstance(node, TreeNode)
        del self._backups[node.id]
        node.l3_stored = op.num_stored == len(op.keys)
        self._context.tree().unprotect_host(node)
        if self._context.events is not None:
            self._context.events.l3_put_done(node, op.num_stored)

    def start_read(self, handle: PrefetchHandle, num_found_pages: int) -> bool:
        """Allocate host pages for ``num_found_pages`` (within the budget) and queue their
        read; False when nothing is read (none found, no host room, or detaching)."""
        op = handle.op
        if op.cancelled.is_set() or not self.controller.running:
            return False  # detaching: no new reads
        want = min(num_found_pages, self._budget - self._in_flight_pages)
        pages = self._context.alloc_host(want, op.tenant) if want > 0 else no_pages()
        if len(pages) == 0:
            handle.no_room = num_found_pages > 0
            return False
        op.host_pages = pages
        self._in_flight_pages += len(pages)
        handle.in_controller = True
        self.controller.submit_load(op)
        return True

    def _on_stalled(self, call: StalledCall) -> None:
        """Keep what the stalled call may still touch until it returns."""
        op = call.op
        if isinstance(op, BackupOp):
            node = op.owner
            assert isinstance(node, TreeNode)
            self._context.tree().protect_host(node)  # on top of the backup's own protection
            self._stalled_backups[call] = node
        elif isinstance(op, PrefetchOp) and len(call.host_pages):
            handle = op.owner
            assert isinstance(handle, PrefetchHandle)
            handle.quarantined = np.concatenate([handle.quarantined, call.host_pages])
            self._quarantine[call] = call.host_pages

    def _on_returned(self, call: StalledCall) -> None:
        node = self._stalled_backups.pop(call, None)
        if node is not None:
            self._context.tree().unprotect_host(node)
        if isinstance(call.op, BackupOp):  # under tensor parallelism, node flushed or not
            self.agreement.backup_returned(call.op)
        pages = self._quarantine.pop(call, None)
        if pages is not None:
            handle = call.op.owner if isinstance(call.op, PrefetchOp) else None
            if isinstance(handle, PrefetchHandle) and self.agreement.holds(handle):
                # Under tensor parallelism the handle owns them again, and frees them when
                # its slot drops: once every rank's calls returned, the same tick everywhere.
                handle.quarantined = handle.quarantined[~np.isin(handle.quarantined, pages)]
            else:
                self._release_prefetch_pages(pages)
        pages = self._orphaned.pop(call, None)
        if pages is not None:
            self._free_host(pages)

    def _on_queried(self, handle: PrefetchHandle) -> None:
        op = handle.op
        if handle.finished:
            if not handle.replicated:  # else dropped when agreed
                self._handles.discard(handle)
            return
        if handle.replicated:
            return  # the read starts once every rank's lookup has answered (the agreement)
        self.start_read(handle, op.num_existing)

    # ------------------------------------------------------------- helpers
    def _make_host_backed(self, anchor: TreeNode) -> bool:
        """Give every node root..anchor a host copy (issuing device->host copies)."""
        chain: list[TreeNode] = []
        node: TreeNode | None = anchor
        while node is not None and not node.is_root and node.host_pages is None:
            chain.append(node)
            node = node.parent
        return all(self._context.backup_node(item) for item in reversed(chain))

    def _release_owned(self, handle: PrefetchHandle) -> None:
        self._release_prefetch_pages(handle.owned_pages())
        handle.num_released_from = handle.num_kept_pages

    def _release_prefetch_pages(self, pages: PageIds) -> None:
        self._in_flight_pages -= len(pages)
        self._free_host(pages)

    def _free_host(self, pages: PageIds) -> None:
        if len(pages):
            self._context.free_host(pages)

    # -------------------------------------------------------------- detach
    def clear(self) -> None:
        """Remove every page of the store (StorageError when it could not). The tree keeps
        no record of what L3 holds, so nothing else changes: a page cleared away is a
        miss the next time it is looked for, as if the store had evicted it."""
        self.controller.clear_store(max(CLEAR_TIMEOUT_S, self.config.io_timeout_s))

    def close(self) -> None:
        """Drain: finish in-flight calls (by their deadline), cancel queued ones, settle.

        Calls that stalled keep their pages (and nodes) until they return: then
        ``closed`` is still False, and ``poll`` goes on settling them and closes
        the backend once no call is inside it. Under tensor parallelism (every rank
        detaches at the same tick, a broadcast operation) the prefetches keep their
        slots and the backups await agreement as before: every rank's I/O stopped
        but a stalled call may still run on one rank, so the ranks go on agreeing on
        this tier (``agreement.busy``) until each rank's calls returned.
        """
        for handle in self._handles:
            handle.op.cancel()
        self.controller.stop()
        self.poll()
        for handle in list(self._handles):
            self.finish(handle)
        if not self._context.replicated():
            assert not self._handles and not self._backups, "L3 operations left unsettled"
        self._closing = True
        if not self._close_backend_when_idle():
            logger.warning(
                "L3 (%s) detached with %d stalled calls still inside it: their %d host pages "
                "stay reserved until they return, and then the backend is closed",
                self.backend.name, self.controller.num_stalled_calls,
                self.num_quarantined_pages + self._num_stalled_backup_pages(),
            )

    @property
    def closed(self) -> bool:
        """Closed and its backend released (no stalled call left inside it)."""
        return self._backend_closed

    @property
    def settled(self) -> bool:
        """Closed, and nothing of it awaits the ranks' agreement: it holds nothing more."""
        return self._backend_closed and not self.agreement.busy

    def _close_backend_when_idle(self) -> bool:
        if not self._backend_closed:
            if self.controller.num_stalled_calls or self._quarantine or self._orphaned or (
                self._stalled_backups
            ):
                return False
            # Marked first: a backend whose close raises is not closed again at every poll.
            self._backend_closed = True
            self.backend.close()
        return True

    def _num_stalled_backup_pages(self) -> int:
        return sum(len(call.host_pages) for call in self._stalled_backups)

    def retain_stalled_host_pages(self, host_pages: PageIds) -> PageIds:
        """The tree is being dropped (flush) and ``host_pages`` freed: which may be.

        Pages a stalled ``set`` may still read stay reserved until it returns;
        the others are returned for the caller to free. Under tensor parallelism a
        ``set`` may have stalled on another rank only: every backup the ranks have not
        agreed finished keeps its pages, on every rank, until they agree it (the
        agreement frees them then, the same tick everywhere).
        """
        if self._context.replicated():
            for op in self.agreement.orphan_backups():
                node = op.owner
                assert isinstance(node, TreeNode)
                del self._backups[node.id]
            # Their nodes leave with the tree; a return still reaches the agreement.
            self._stalled_backups.clear()
            kept = self.agreement.orphaned_pages()
            if not kept:
                return host_pages
            return host_pages[~np.isin(host_pages, np.concatenate(kept))]
        for call in self._stalled_backups:
            self._orphaned[call] = call.host_pages
        self._stalled_backups.clear()
        if not self._orphaned:
            return host_pages
        reserved = np.concatenate(list(self._orphaned.values()))
        return host_pages[~np.isin(host_pages, reserved)]

    def metrics(self) -> StorageMetrics:
        return self.controller.snapshot()

    @property
    def prefetch_timeout_per_ki_token_s(self) -> float:
        """The timeout policy's seconds per 1024 tokens in force (configured or observed)."""
        return self.config.per_ki_token_s(self.read_time.allowance_per_ki_token_s())

    def held_host_pages(self) -> PageIds:
        """Host pages held for L3 outside the tree: for integrity checks.

        Those of prefetches (not yet in the tree) and those reserved for
        stalled calls.
        """
        parts = [handle.owned_pages() for handle in self._handles]
        parts += [*self._quarantine.values(), *self._orphaned.values()]
        parts += self.agreement.orphaned_pages()
        return np.concatenate(parts) if parts else no_pages()
