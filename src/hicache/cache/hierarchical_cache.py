"""HierarchicalCache: the radix tree, both pools and the controller, driven together.

This is what a scheduler talks to. All methods run on the scheduler thread and
never block on I/O, except where the caller asks for room that only a
finished copy can make (write_back eviction, or every evictable page locked by
an in-flight write): then it waits for those device->host copies, which is the
price write_back pays by design.

Request protocol:
    hit = cache.acquire(tokens)         # match, lock, start loading the host part
    pages = cache.alloc_device(n)       # room for the tokens to compute (evicts)
    ... compute; before layer l: cache.wait_layer(l) ...
    cache.insert(tokens, hit.device_pages ++ pages)  # hand the pages to the tree
    cache.release(hit)
    cache.poll()                        # once per scheduler tick: acknowledge writes

Invariants:

- ``acquire`` loads the host part of a match only when it is worth it, at least
  ``load_back_threshold_tokens`` tokens, and the device pool can make room for it
  (evicting); otherwise the hit is the device part alone and the host tokens are
  recomputed;
- a page read from L3 that fails its checksum when loaded ends the hit there: the
  pages before it are loaded (a node holding both is split at the bad page), the node
  starting with the bad page and what hangs from it are dropped from the tree (their
  host pages freed) unless something still uses them, the bad page's object is
  discarded from L3 when this rank writes to L3, and its tokens are recomputed, so
  the recomputed KV is stored in its place;
- ``check_integrity()`` proves every page is owned exactly once, in each pool: by the
  tree, by a request (the device pages the caller says requests hold; the host pages
  the L3 tiers hold outside the tree, for prefetches and stalled calls), or by the
  free list.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.cache.hints import HintBook
from hicache.cache.l3_agreement import L3Progress
from hicache.cache.l3_context import L3Context
from hicache.cache.stats import CacheStats
from hicache.config import CacheConfig
from hicache.controller.controller import CacheController
from hicache.memory.allocator import OutOfPagesError, PageAllocator, PageIds
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_memory import host_memory_for_pools
from hicache.memory.host_pool import IDLE_FAULT_BYTES, HostPool
from hicache.radix.keys import KeyNamespace, TokenIds, num_tokens, pack_tokens
from hicache.radix.node import TreeNode
from hicache.radix.results import InsertResult, PrefixPeek, no_pages
from hicache.radix.tree import HiRadixTree, TenantRemoval
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError
from hicache.storage.config import StorageConfig
from hicache.storage.controller import PurgeOp
from hicache.transfer import create_io_backend

if TYPE_CHECKING:
    from hicache.cache.drain import L3Drain
    from hicache.cache.l3 import PrefetchHandle, StorageTier
    from hicache.cache.warm import L3Warm
    from hicache.events.emitter import KVEventEmitter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadBack:
    """What a load-back moved: device pages, the last node they cover (None: nothing
    loaded), and the node whose first page failed its check, if one did."""

    device_pages: PageIds
    last_node: TreeNode | None
    corrupt: TreeNode | None = None


@dataclass(frozen=True)
class PrefixHit:
    """A locked, usable cached prefix of a request.

    ``device_pages`` cover ``num_tokens`` tokens: ``num_device_tokens`` were
    already on the device, ``num_host_tokens`` are being loaded from the host
    (compute must call ``wait_layer`` before reading them).
    """

    device_pages: PageIds
    num_device_tokens: int
    num_host_tokens: int
    node: TreeNode

    @property
    def num_tokens(self) -> int:
        return self.num_device_tokens + self.num_host_tokens


class HierarchicalCache:
    def __init__(
        self,
        config: CacheConfig,
        geometry: KVGeometry,
        device_num_pages: int,
        device: torch.device | str = "cpu",
        model_name: str = "model",
        storage: StorageConfig | None = None,
        events: KVEventEmitter | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        host_num_pages: int | None = None,
    ) -> None:
        """``tp_rank``/``tp_size``: this cache holds that tensor-parallel rank's KV shard
        (its L3 keys say so; an MLA rank holds the whole latent, so its keys do not).
        ``host_num_pages``: the host pool's size when decided elsewhere (ranks must
        agree on it); None: from ``config``."""
        self.config = config
        # Turns tier transitions into KV events (None: events off, nothing is hashed).
        self.events = events
        self.page_size = config.page_size
        self.device_pool = DevicePool(geometry, device_num_pages, config.page_size, device)
        # An MLA latent is the same on every tensor-parallel rank: its pages are named
        # without the TP layout (instances of any TP size share them) and only rank 0
        # writes them to L3; every rank reads them. MHA ranks hold different KV heads.
        key_rank, key_size = (0, 1) if geometry.is_mla else (tp_rank, tp_size)
        self.writes_to_l3 = tp_rank == 0 or not geometry.is_mla
        namespace = KeyNamespace(
            model_name, geometry.describe(), config.page_size, tp_rank=key_rank, tp_size=key_size
        )
        self.stats = CacheStats()
        self.host_pool: HostPool | None = None
        self.controller: CacheController | None = None
        # Each tenant's host quota in pages (tenant_host_fractions of the host pool).
        self.host_quotas: dict[str | None, int] = {}
        if config.enable_hierarchical_cache:
            page_bytes = geometry.page_bytes(self.page_size)
            host_pages = host_num_pages if host_num_pages is not None else config.host_num_pages(
                device_num_pages, page_bytes, host_memory_for_pools()
            )
            self.host_quotas = {
                tenant: int(share * host_pages)
                for tenant, share in config.tenant_host_fractions.items()
            }
            self.host_pool = HostPool(geometry, host_pages, config.page_size, config.mem_layout)
            io = create_io_backend(config.io_backend, self.host_pool, self.device_pool)
            self.controller = CacheController(io)
            self.controller.start()
            # With a CPU device the load can check L3 pages while copying them
            # (memory.page_digests); under tensor parallelism the ranks would have to
            # agree on every verdict, so there each L3 read verifies its pages itself.
            if self.controller.copier is not None and tp_size == 1:
                self.host_pool.digests.defer_checks = True
        self.tree = HiRadixTree(
            config.page_size, config.write_policy, namespace, events, self.host_quotas,
            self._core_pages(),
        )
        self._writing: dict[int, TreeNode] = {}
        # Device nodes whose host copy found no room when they were inserted (the host
        # full of pages a request holds or that wait for their L3 write), by node id in
        # insertion order: each insert tries them again first (``_retry_deferred``), so a
        # burst that outruns L3 for a moment does not lose its pages to the next device
        # eviction. An entry is dropped once copied, or gone from the device.
        self._deferred: dict[int, TreeNode] = {}
        self.storage: StorageTier | None = None
        # The drain to L3 under way before the worker exits (``cache/drain.py``), if any.
        self.l3_drain: L3Drain | None = None
        # Warms from L3 under way (``cache/warm.py``), by the id their caller gave.
        self.l3_warms: dict[str, L3Warm] = {}
        # Under tensor parallelism (set by the replicated scheduler before any request):
        # L3 decisions wait for the ranks' agreement and read the tick clock.
        self.replicated = False
        self.clock: Callable[[], float] = time.monotonic
        # What hints asked (``cache/hints.py``): pins, retains, their prefetches.
        self.hints = HintBook(self)
        # Detached tiers whose stalled L3 calls have not returned: polled until they
        # do, since the host pages those calls may touch are reserved until then.
        self._retired_storage: list[StorageTier] = []
        # Nodes a tenant purge removed from L1 and L2, by tenant, until its L3 pass
        # announces their L3 copies gone (``begin_purge_tenant_l3``).
        self._purged_nodes: dict[str | None, list[TreeNode]] = {}
        # L3 purges queued and not yet finished: their removed nodes, by purge id.
        self._l3_purges: dict[int, list[TreeNode]] = {}
        # Why L3 is not attached although configured (reported by /health and logs).
        self.storage_error: str | None = None
        # The server's L3 encryption keys: every store attached, at start-up or later
        # through the admin API, seals its pages with them (never plaintext).
        self.l3_encryption = storage.encryption if storage is not None else None
        # ``--tenant-quotas`` for L3: kept for a store attached later without them (the
        # admin attach endpoint), so every store this server attaches enforces them.
        self.tenant_quotas = None if storage is None else storage.tenant_quotas
        if storage is not None and storage.enabled:
            try:
                self.attach_storage(storage)
            except StorageUnavailableError as error:
                self.storage_error = str(error)
                logger.error(
                    "L3 storage %r is unreachable: %s. STARTING WITHOUT L3; attach it later "
                    "through the admin API once it is up.", storage.backend, error,
                )

    @property
    def hierarchical(self) -> bool:
        return self.controller is not None

    def close(self) -> None:
        self.detach_storage()
        if self.controller is not None:
            self.poll(wait=True)
            self.controller.stop()
        self.publish_events()

    def publish_events(self) -> None:
        """Hand the KV events since the last call to the publisher, as one batch.

        The scheduler calls it once per step; a no-op when events are off.
        """
        if self.events is not None:
            self.events.end_step()

    # ------------------------------------------------------------ L3 tier
    def attach_storage(
        self, config: StorageConfig, backend: StorageBackend | None = None
    ) -> None:
        """Attach an L3 backend (built from ``config`` unless given).

        Re-attaching the backend already attached only updates the policies.
        Raises StorageError (StorageUnavailableError when the store cannot be
        reached), leaving the cache as it was.
        """
        if self.host_pool is None:
            raise StorageError(
                "L3 storage needs the host pool: add --enable-hierarchical-cache"
            )
        if config.encryption is None and self.l3_encryption is not None:
            config = replace(config, encryption=self.l3_encryption)  # an admin API attach
        if config.tenant_quotas is None:
            config = replace(config, tenant_quotas=self.tenant_quotas)
        self.tenant_quotas = config.tenant_quotas
        if self.storage is not None:
            if backend is None and self.storage.config.same_backend(config):
                self.storage.config = config
                self.storage.backend.set_tenant_quotas(config.tenant_quotas)
                return
            raise StorageError(
                f"L3 backend {self.storage.backend.name!r} is attached: detach it first"
            )
        if backend is None:
            # Imported on use: backends pull in optional dependencies.
            registry = importlib.import_module("hicache.storage.registry")
            assert config.backend is not None
            backend = registry.create_storage_backend(config.backend, config.backend_extra)
            assert isinstance(backend, StorageBackend)
        try:
            if config.encryption is not None and backend.sealer is None:
                from hicache.storage.sealing import Sealer  # cryptography: loaded on use

                backend.use_sealer(Sealer(config.encryption))
            backend.set_tenant_quotas(config.tenant_quotas)
            backend.forward_runs_on_cpu(self.device_pool.device.type == "cpu")
            backend.attach(self.host_pool)
        except Exception:
            backend.close()
            raise
        from hicache.cache.l3 import StorageTier

        self.storage = StorageTier(self._l3_context(self.host_pool), config, backend)
        self.storage_error = None
        logger.info("L3 storage attached: %s", backend.name)

    def _l3_context(self, host_pool: HostPool) -> L3Context:
        """What an L3 tier may see and change of this cache (``cache/l3_context.py``)."""
        return L3Context(
            page_size=self.page_size,
            host_num_pages=host_pool.num_pages,
            writes_to_l3=self.writes_to_l3,
            stats=self.stats,
            events=self.events,
            # Read when called: a flush replaces the tree, and the replicated scheduler
            # sets replicated and its clock after a store may have been attached.
            tree=lambda: self.tree,
            replicated=lambda: self.replicated,
            clock=lambda: self.clock(),
            alloc_host=self.alloc_host,
            free_host=host_pool.allocator.free,
            backup_node=self.backup_node,
            host_page_bytes=host_pool.page_bytes,
        )

    def detach_storage(self) -> None:
        """Drain in-flight L3 work and detach; a no-op when nothing is attached."""
        if self.storage is None:
            return
        storage, self.storage = self.storage, None
        try:
            storage.close()
        finally:
            # Even when its backend's close raised: what its stalled calls hold, and under
            # tensor parallelism what awaits the ranks' agreement, is still released.
            if not storage.settled:
                self._retired_storage.append(storage)
        logger.info("L3 storage detached: %s", storage.backend.name)

    def clear_storage(self) -> None:
        """Remove every page of the attached L3 store; StorageError without one, or when
        the store could not be cleared. L1 and L2 are unchanged."""
        if self.storage is None:
            raise StorageError("no L3 storage backend is attached")
        self.storage.clear()

    def prefetch(self, tokens: TokenIds, extra_key: str | None = None) -> PrefetchHandle | None:
        """Start fetching from L3 what the local tiers miss of ``tokens``; None if not worth it.

        Call before ``acquire``; hold the request until ``prefetch_ready``, then
        ``finish_prefetch`` and ``acquire`` (which then finds the pages on the host).
        """
        if self.storage is None:
            return None
        return self.storage.start(pack_tokens(tokens), extra_key)

    def prefetch_ready(self, handle: PrefetchHandle) -> bool:
        """May the request start now, under the prefetch policy?"""
        return handle.finished or self.storage is None or self.storage.ready(handle)

    def await_prefetch_lookup(self, handle: PrefetchHandle, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (once per prefetch) for what L3 answered of it, applied;
        True when the answer came (``StorageTier.await_lookup``)."""
        return self.storage is not None and self.storage.await_lookup(handle, timeout_s)

    def await_prefetch_read(self, handle: PrefetchHandle, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for its L3 read to end, applied; True when it ended
        (``StorageTier.await_read``: not when the read is predicted to take longer)."""
        return self.storage is not None and self.storage.await_read(handle, timeout_s)

    def prefetch_done(self, handle: PrefetchHandle) -> bool:
        """Will nothing more of it land in time? Then settle it even if its request waits.

        Unlike ``prefetch_ready`` this does not hold under best_effort while pages
        are still coming: a request that must queue anyway keeps fetching.
        """
        return handle.finished or self.storage is None or self.storage.done(handle)

    def prefetch_landed_tokens(self, handle: PrefetchHandle) -> int:
        """Tokens of the prefetch already on the host (``finish_prefetch`` would insert them)."""
        if self.storage is None:
            return handle.num_inserted_tokens
        return self.storage.num_landed_tokens(handle)

    @property
    def prefetch_slot_free(self) -> bool:
        """May a prefetch start now? Under tensor parallelism it needs an agreement slot."""
        return self.storage is None or not self.replicated or self.storage.agreement.slot_free

    def prefetch_wanted_pages(self, tokens: TokenIds, extra_key: str | None = None) -> int:
        """Pages a prefetch of ``tokens`` would ask L3 for now (0: it would not start)."""
        if self.storage is None:
            return 0
        peek = self.peek(tokens, extra_key)
        missing = (
            num_tokens(tokens) // self.page_size - peek.num_device_pages - peek.num_host_pages
        )
        if missing * self.page_size < max(1, self.storage.config.prefetch_threshold):
            return 0
        return missing

    def prefetch_pages(self, handle: PrefetchHandle) -> int:
        """Host pages the prefetch may take: what L3 found, or what it asked for until then."""
        if handle.finished:
            return handle.num_inserted_tokens // self.page_size
        found = handle.num_found_tokens
        return (found if found >= 0 else handle.num_requested_tokens) // self.page_size

    @property
    def prefetch_budget_pages(self) -> int:
        """Host pages L3 prefetches may hold at once (``prefetch_max_host_fraction``)."""
        return 0 if self.storage is None else self.storage.prefetch_budget_pages

    def finish_prefetch(self, handle: PrefetchHandle) -> int:
        """Insert what has arrived; returns the tokens L3 contributed."""
        if self.storage is None or handle.finished:
            return handle.num_inserted_tokens
        return self.storage.finish(handle)

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        if self.storage is not None and not handle.finished:
            self.storage.finish(handle, keep=False)

    # ------------------------------------------------------------ requests
    def peek(self, tokens: TokenIds, extra_key: str | None = None) -> PrefixPeek:
        """The cached prefix ``acquire`` would find, with no lock, load, or statistics."""
        return self.tree.peek_prefix(pack_tokens(tokens), extra_key)

    def touch(self, tokens: TokenIds, extra_key: str | None = None) -> None:
        """Mark the cached prefix of ``tokens`` as just used (eviction takes the least
        recently used first), with no lock, load, or statistics: the scheduler's waiting
        requests keep their prefixes this way until they are admitted."""
        self.tree.match_prefix(pack_tokens(tokens), extra_key)

    def acquire(
        self, tokens: TokenIds, extra_key: str | None = None, record_hit: bool = True,
        max_tokens: int | None = None,
    ) -> PrefixHit:
        """Match ``tokens``, lock the hit and start loading its host part to the device.

        ``record_hit=False`` leaves the hit statistics alone: for a request
        acquiring again (after a retraction), whose hit was counted already.
        ``max_tokens``: match no further (the rest is computed again, by choice);
        the statistics still count all of ``tokens`` as asked for.
        """
        data = pack_tokens(tokens)
        asked = len(data) // 4
        if max_tokens is not None:
            data = data[: max(max_tokens, 0) * 4]
        match = self.tree.match_prefix(data, extra_key, use=True)
        node = match.last_node
        self.tree.lock(node)
        pages = match.device_pages
        loaded = 0
        corrupt: TreeNode | None = None
        if match.num_host_tokens and self._worth_loading(match.num_host_tokens):
            load = self._load_back(match.host_pages, self.tree.host_path(match))
            corrupt = load.corrupt
            if load.last_node is not None:
                pages = np.concatenate([pages, load.device_pages])
                loaded = len(load.device_pages) * self.page_size
                if load.last_node is not node:  # a page failed its check: hold the good part
                    self.tree.lock(load.last_node)
                    self.tree.unlock(node)
                    node = load.last_node
        if loaded == 0 and node is not match.last_device_node:
            # Not loading: hold only the device part.
            self.tree.lock(match.last_device_node)
            self.tree.unlock(node)
            node = match.last_device_node
        if corrupt is not None:  # unlocked by now (unless another request holds it)
            self._drop_corrupt(corrupt)
        if record_hit:
            self.stats.record_hit(asked, match.num_device_tokens, loaded)
        return PrefixHit(pages, match.num_device_tokens, loaded, node)

    def release(self, hit: PrefixHit) -> None:
        self.tree.unlock(hit.node)

    def insert(
        self, tokens: TokenIds, device_pages: PageIds, extra_key: str | None = None
    ) -> InsertResult:
        """Give the KV of ``tokens`` (whole pages) to the tree; frees duplicates, backs up."""
        if self._deferred:
            self._retry_deferred()
        result = self.tree.insert(tokens, device_pages, extra_key)
        self.device_pool.allocator.free(result.duplicate_pages)
        candidates = result.backup_candidates
        for i, node in enumerate(candidates):
            if not self._backup(node):
                # Its descendants may not be backed up before it: all wait for room.
                if self.host_pool is not None:
                    self._deferred.update((n.id, n) for n in candidates[i:])
                break
        return result

    def _retry_deferred(self) -> None:
        """Copy to the host the deferred nodes still on the device, oldest first, as far
        as there is room. A node whose copy fails again stays, and so do the rest of its
        tenant's (its quota or the pool is what is short); other tenants' go on. Runs at
        an insert, where every rank of a tensor-parallel group has the same tree."""
        blocked: set[str | None] = set()
        for node_id, node in list(self._deferred.items()):
            if node.extra_key in blocked:
                continue
            parent = node.parent
            if (
                parent is None or node.device_pages is None or node.host_pages is not None
                or not (parent.is_root or parent.host_pages is not None)
            ):
                # Deleted, evicted, copied since (a later insert of it), or below a node
                # that will not be copied first (split off or gone): nothing to do.
                del self._deferred[node_id]
                continue
            if self._backup(node, count_skip=False):
                del self._deferred[node_id]
                self.stats.num_backup_late_pages += len(node.device_pages)
            else:
                blocked.add(node.extra_key)

    def insert_held(
        self, tokens: TokenIds, device_pages: PageIds, hit: PrefixHit,
        extra_key: str | None = None,
    ) -> PrefixHit:
        """Insert what a running request computed and keep holding it.

        The request's pages the tree already had (computed twice) are freed and
        replaced by the tree's in the returned hit, which the request holds
        instead of ``hit``: its whole ``tokens`` are now a locked device prefix.
        """
        self.insert(tokens, device_pages, extra_key)
        match = self.tree.match_prefix(pack_tokens(tokens), extra_key)
        assert match.num_device_tokens == len(tokens), "inserted tokens are not all on device"
        self.tree.lock(match.last_node)
        self.release(hit)
        return PrefixHit(
            match.device_pages, hit.num_device_tokens, hit.num_host_tokens, match.last_node
        )

    def flush(self) -> None:
        """Forget every cached prefix in L1 and L2 (L3 keeps its pages).

        Only when no request holds anything (the engine checks it is idle).
        """
        self.poll(wait=True)
        if self.storage is not None:
            # Idle: every backup finishes (a stalled one at its deadline).
            self.storage.controller.wait_idle()
            self.storage.poll()
        if self.tree.num_protected_device_pages:
            raise RuntimeError("flush while requests hold cached prefixes")
        self.hints.clear()  # every pin and class goes with the tree
        self._deferred.clear()
        self._purged_nodes.clear()
        self._l3_purges.clear()
        self.device_pool.allocator.free(self.tree.device_page_ids())
        if self.host_pool is not None:
            host_pages = self.tree.host_page_ids()
            for tier in self._storage_tiers():
                host_pages = tier.retain_stalled_host_pages(host_pages)
            self.host_pool.allocator.free(host_pages)
        self.tree = HiRadixTree(
            self.page_size, self.config.write_policy, self.tree.namespace, self.events,
            self.host_quotas, self._core_pages(),
        )
        if self.events is not None:
            self.events.cleared()

    # ------------------------------------------------------------ tenants
    def purge_tenant(self, tenant: str | None) -> TenantRemoval:
        """Remove every page of ``tenant`` from L1 and L2 that nothing holds, and free it.

        The tenant's pins go first (``HintBook.drop_extra_key``): a purge outranks a hint.
        Landed device->host copies are acknowledged first, so only pages a request, a copy
        or an L3 call still holds are left (counted in the result; the caller aborts the
        tenant's requests and calls again until none is left). The KV events of each tier
        go out with the next batch; the removed nodes are kept for ``begin_purge_tenant_l3``.
        """
        self.poll(wait=True)
        self.hints.drop_extra_key(tenant)
        removal = self.tree.remove_tenant(tenant)
        self.device_pool.allocator.free(removal.device_pages)
        if self.host_pool is not None:
            self.host_pool.allocator.free(removal.host_pages)
        if removal.nodes and self.events is not None:
            self._purged_nodes.setdefault(tenant, []).extend(removal.nodes)
        return removal

    def begin_purge_tenant_l3(
        self, tenant: str | None, timeout_s: float
    ) -> tuple[PurgeOp | None, str | None]:
        """Queue the removal of ``tenant``'s objects from the attached L3 store and return
        at once (the store's work runs on its write thread, never this one): (the queued
        purge, None), (None, None) where another rank purges the store, or (None, why not)
        without L3 or when it cannot. The caller waits for the purge off the scheduler
        thread (``StorageController.wait_purge``), then calls ``finish_purge_tenant_l3``."""
        nodes = self._purged_nodes.pop(tenant, [])
        if self.storage is None:
            return None, "no L3 storage is attached"
        if not self.writes_to_l3:
            return None, None  # an MLA follower rank: rank 0 purges the store they share
        try:
            op = self.storage.controller.submit_purge(tenant, timeout_s)
        except StorageError as error:
            return None, str(error)
        self._l3_purges[id(op)] = nodes
        return op, None

    def finish_purge_tenant_l3(self, purge_id: int, purged: bool) -> None:
        """The L3 purge ``purge_id`` (``id`` of what ``begin_purge_tenant_l3`` returned) is
        over: when it ``purged``, the pages the purge removed from L1 and L2 that this
        worker had seen in L3 are announced gone from it (EXTERNAL). Unknown ids (another
        rank's, or a cleared cache's) are ignored."""
        nodes = self._l3_purges.pop(purge_id, None)
        if purged and nodes and self.events is not None:
            self.events.l3_removed(nodes)

    def alloc_device(self, num_pages: int) -> PageIds:
        """``num_pages`` free device pages, evicting from the tree as needed."""
        allocator = self.device_pool.allocator
        while not allocator.can_allocate(num_pages):
            short = num_pages - allocator.num_free_pages
            eviction = self.tree.evict_device(short)
            if len(eviction.freed_pages):
                allocator.free(eviction.freed_pages)
                self.stats.num_device_evicted_pages += len(eviction.freed_pages)
                continue
            if eviction.pending_write_back:
                issued = 0
                for node in eviction.pending_write_back:
                    # The only way to free these device pages: past the tenant's quota
                    # if its own host pages cannot make room (it evicts them first).
                    if not self._backup(node, within_quota=False):
                        break
                    issued += 1
                if issued == 0:
                    break
                self.poll(wait=True)
                continue
            if self.controller is not None and self.controller.num_pending_writes:
                # Everything evictable is locked by in-flight writes: let them land.
                self.poll(wait=True)
                continue
            break
        if not allocator.can_allocate(num_pages):
            raise OutOfPagesError(
                f"device pool: need {num_pages} pages, {allocator.num_free_pages} free and "
                f"nothing more evictable ({self.tree.num_protected_device_pages} pages locked)"
            )
        return allocator.allocate(num_pages)

    def free_device(self, pages: PageIds) -> None:
        """Return pages a request held but did not insert (e.g. a partial last page)."""
        self.device_pool.allocator.free(pages)

    def fault_in_host_memory(self) -> bool:
        """For an idle scheduler: fault in the next piece of the host pool's memory, whose
        first write would otherwise pay the kernel's page faults on the copy thread,
        beside the forward (``memory.prefault``); True while more is left."""
        pool = self.host_pool
        return pool is not None and pool.fault_in_more(IDLE_FAULT_BYTES)

    def wait_layer(self, layer: int) -> None:
        if self.controller is not None:
            self.controller.wait_layer(layer)

    def poll(self, wait: bool = False) -> int:
        """Acknowledge landed writes (all in-flight ones if ``wait``); returns how many."""
        if self.controller is None:
            self.hints.poll()  # retains expire on a device-only cache too
            return 0
        if wait:
            return self._acknowledge(self.controller.wait_writes(), wait=True)
        return self.apply_progress(self.observe_progress())

    def observe_progress(self) -> int:
        """This process's progress to agree on before ``apply_progress``: how many of the
        oldest L2 writes have landed, in submission order. Acknowledges nothing.

        ``poll()`` is the two halves back to back; ranks of a tensor-parallel group put
        the agreed (minimum) value between them, so that every rank's tree changes alike.
        """
        return 0 if self.controller is None else self.controller.num_landed_writes()

    def apply_progress(self, num_landed_writes: int) -> int:
        """Acknowledge the ``num_landed_writes`` oldest writes (at most what
        ``observe_progress`` saw) and advance L3 work; returns how many were acknowledged."""
        if self.controller is None:
            self.hints.poll()
            return 0
        acknowledged = self._acknowledge(
            self.controller.take_writes(num_landed_writes), wait=False
        )
        # After the copies are acknowledged: an L3 pin waiting for them goes out now.
        self.hints.poll()
        return acknowledged

    def observe_l3_progress(self) -> L3Progress:
        """Under tensor parallelism: this rank's L3 progress to agree on (changes nothing)."""
        tier = self._agreed_tier()
        if tier is None:
            return L3Progress()
        return tier.agreement.observe(self.clock())

    def apply_l3_progress(self, agreed: L3Progress) -> None:
        """Take the L3 progress the ranks agreed on (after ``apply_progress``)."""
        tier = self._agreed_tier()
        if tier is not None:
            tier.agreement.apply(agreed)

    @property
    def l3_awaits_agreement(self) -> bool:
        """Under tensor parallelism: does L3 work await the ranks' agreement (a prefetch
        draining, a backup not agreed finished), in the attached tier or a detached one?"""
        tier = self._agreed_tier()
        return tier is not None and tier.agreement.busy

    def _agreed_tier(self) -> StorageTier | None:
        """The tier whose L3 work the ranks agree on: the attached one, else a detached one
        whose work still awaits agreement (under tensor parallelism L3 cannot be attached
        again, so there is at most one; which one it is follows from agreed state)."""
        if self.storage is not None:
            return self.storage
        busy = [tier for tier in self._retired_storage if tier.agreement.busy]
        assert len(busy) <= 1, "two detached L3 tiers await agreement"
        return busy[0] if busy else None

    def _acknowledge(self, tokens: list[int], wait: bool) -> int:
        assert self.controller is not None
        for token in tokens:
            node = self._writing.pop(token)
            self.tree.finish_backup(node)
            if self.events is not None:  # the copy has landed: the host holds the KV now
                self.events.host_copy_landed(node)
            if self.storage is not None and node.host_pages is not None:
                self.storage.backup(node)
        if wait:
            self.controller.wait_loads()
        if self.storage is not None:
            self.storage.poll()
        if self._retired_storage:
            for tier in self._retired_storage:
                tier.poll()
            self._retired_storage = [t for t in self._retired_storage if not t.settled]
        return len(tokens)

    # ------------------------------------------------------------ internals
    def _core_pages(self) -> int | None:
        """The host tier's core set in pages (radix/tree.py), or None: LRU alone."""
        fraction = self.config.host_core_fraction
        if self.host_pool is None or fraction <= 0:
            return None
        return int(fraction * self.host_pool.num_pages)

    def _storage_tiers(self) -> list[StorageTier]:
        """The attached L3 tier and detached ones still waiting on stalled calls."""
        attached = [self.storage] if self.storage is not None else []
        return [*attached, *self._retired_storage]

    def _worth_loading(self, num_host_tokens: int) -> bool:
        return num_host_tokens >= self.config.load_back_threshold_tokens

    def _load_back(self, host_pages: PageIds, nodes: list[TreeNode]) -> LoadBack:
        """Load the host-only ``nodes`` (their pages ``host_pages``) to the device.

        Pages read from L3 whose payload is not verified yet are checked while they
        are copied (a whole-page copy, waited for); from the first page that fails,
        nothing is loaded (its node is split there) and those tokens are recomputed.
        """
        assert self.controller is not None and self.host_pool is not None
        try:
            device_pages = self.alloc_device(len(host_pages))
        except OutOfPagesError:
            logger.debug("no device room to load %d host pages; recomputing", len(host_pages))
            return LoadBack(no_pages(), None)
        sizes = [len(node.tokens) // self.tree.page_bytes for node in nodes]
        corrupt: TreeNode | None = None
        if self.host_pool.digests.expected(host_pages).any():
            good = self.controller.load_verified(host_pages, device_pages)
            if good < len(host_pages):
                nodes, sizes, corrupt = self._cut_at_bad_page(host_pages, nodes, sizes, good)
                keep = sum(sizes)
                self.free_device(device_pages[keep:])
                device_pages = device_pages[:keep]
        else:
            self.controller.load(host_pages, device_pages)
        offset = 0
        for node, n in zip(nodes, sizes, strict=True):
            self.tree.set_device_pages(node, device_pages[offset : offset + n])
            offset += n
        self.stats.num_loaded_pages += len(device_pages)
        return LoadBack(device_pages, nodes[-1] if nodes else None, corrupt)

    def _cut_at_bad_page(
        self, host_pages: PageIds, nodes: list[TreeNode], sizes: list[int], good: int
    ) -> tuple[list[TreeNode], list[int], TreeNode]:
        """The nodes (and their sizes in pages) that hold the pages before page ``good``,
        the first that failed its check, and the node that now starts with that page (a
        node holding good pages and bad ones is split at the first bad one)."""
        self.stats.num_corrupt_pages += 1
        logger.warning(
            "a page read from L3 failed its checksum when loaded (host page %d): its prefix "
            "is recomputed from there", int(host_pages[good]),
        )
        kept, end = 0, 0
        while end + sizes[kept] <= good:
            end += sizes[kept]
            kept += 1
        bad = nodes[kept]
        if good == end:
            return nodes[:kept], sizes[:kept], bad
        upper = self.tree.split(bad, good - end)
        return [*nodes[:kept], upper], [*sizes[:kept], good - end], bad

    def _drop_corrupt(self, node: TreeNode) -> None:
        """Forget ``node`` (its first page failed its check) and what hangs from it, in
        the tree and in L3, so that the recomputed KV is stored in their place.

        When something still uses them (another request, an L3 call), they stay: their
        pages are still unverified, so every load checks and refuses them again.
        """
        assert self.host_pool is not None
        if self.storage is not None and self.writes_to_l3:
            self.storage.discard(self.tree.page_keys(node)[:1])
        freed = self.tree.drop_host_subtree(node)
        if freed is not None:
            self.host_pool.allocator.free(freed)

    def alloc_host(
        self, num_pages: int, tenant: str | None = None, within_quota: bool = True,
        include_core: bool = True,
    ) -> PageIds:
        """Up to ``num_pages`` free host pages for ``tenant``'s KV, evicting host-only LRU
        leaves for room.

        A tenant with a host quota gets no more than the quota leaves it: past it, its
        own least recently used host-only pages are evicted first (never another
        tenant's; a host copy of a page still on the device stays until the page leaves
        the device), and what they cannot make room for (held, or on the device) is not
        given: a backup without its pages is skipped, the request still answers.
        ``within_quota=False`` (a write_back eviction, whose backup is the only way to free
        a device page) still evicts the tenant's own pages first but may then take it past
        its quota; its next allocations evict its own pages until it is back under it.
        ``include_core=False`` (pages that will not join the core set) evicts only pages
        outside it: what they cannot make room for is not given. The
        quota counts the pages in the tree: pages a prefetch holds until it lands count
        from then on, so prefetches in flight together may overshoot it by their size.
        """
        assert self.host_pool is not None
        quota = self.tree.host_quota(tenant)
        if quota is not None:
            over = self.tree.tenant_host_pages(tenant) + num_pages - quota
            if over > 0:
                freed = self.tree.evict_host_tenant(tenant, over)
                self.host_pool.allocator.free(freed)
                self.stats.num_host_evicted_pages += len(freed)
                self.stats.num_host_quota_evicted_pages += len(freed)
                if within_quota:
                    room = max(0, quota - self.tree.tenant_host_pages(tenant))
                    num_pages = min(num_pages, room)
        allocator = self.host_pool.allocator
        if not allocator.can_allocate(num_pages):
            freed = self.tree.evict_host(num_pages - allocator.num_free_pages, include_core)
            allocator.free(freed)
            self.stats.num_host_evicted_pages += len(freed)
        pages = allocator.allocate(min(num_pages, allocator.num_free_pages))
        self.host_pool.digests.forget(pages)  # whatever the pages held before is gone
        return pages

    def copying_to_host(self, node: TreeNode) -> bool:
        """Is a device->host copy of ``node`` in flight (its L3 write follows when it lands)?"""
        return node.id in self._writing

    def backup_node(self, node: TreeNode) -> bool:
        """Start copying device-only ``node`` to the host; False when there is no room."""
        return self._backup(node)

    def _backup(
        self, node: TreeNode, within_quota: bool = True, count_skip: bool = True
    ) -> bool:
        """Start copying ``node`` to the host; False when the host pool has no room (or,
        ``within_quota``, its tenant's host quota leaves none: ``alloc_host``), counted
        as skipped pages unless ``count_skip`` is False (a deferred copy tried again)."""
        if self.controller is None or self.host_pool is None:
            return False
        assert node.device_pages is not None
        need = len(node.device_pages)
        # A write_back eviction must free the device page; a copy that will not join the
        # core set must not push a core page out (it would be the next one to come back).
        include_core = not within_quota or self.tree.joins_core(node)
        host_pages = self.alloc_host(need, node.extra_key, within_quota, include_core)
        if len(host_pages) < need:
            self.host_pool.allocator.free(host_pages)
            if count_skip:
                self.stats.num_backup_skipped_pages += need
            return False
        self.tree.begin_backup(node, host_pages)
        self._writing[node.id] = node
        if self.events is not None:
            self.events.host_copy_issued(node)
        # Checksummed on the way when L3 will store the page (its frame needs it).
        self.controller.write(
            node.device_pages, host_pages, node.id, digest=self.storage is not None
        )
        self.stats.num_backed_up_pages += need
        return True

    # ------------------------------------------------------------ integrity
    def check_integrity(self, held_device_pages: PageIds | None = None) -> None:
        """Every page is in exactly one place: the tree, a request (``held``), or a free list."""
        self.tree.check_integrity()
        self.hints.check_integrity()
        self._check_pool(
            self.device_pool.allocator, self.tree.device_page_ids(),
            no_pages() if held_device_pages is None else held_device_pages, "device",
        )
        if self.host_pool is not None:
            host_ids = self.tree.host_page_ids()
            held = [tier.held_host_pages() for tier in self._storage_tiers()]
            self._check_pool(
                self.host_pool.allocator, host_ids,
                np.concatenate(held) if held else no_pages(), "host",
            )

    @staticmethod
    def _check_pool(
        allocator: PageAllocator, tree_pages: PageIds, held: PageIds, name: str
    ) -> None:
        allocator.check_integrity()
        owned = np.concatenate([tree_pages, held])
        seen = np.zeros(allocator.num_pages, dtype=np.bool_)  # linear: no sort of a big pool
        seen[owned] = True
        assert int(np.count_nonzero(seen)) == len(owned), f"{name}: a page has two owners"
        assert allocator.all_allocated(owned), f"{name}: owned page is free"
        assert len(owned) == allocator.num_used_pages, (
            f"{name}: {allocator.num_used_pages} pages allocated but {len(owned)} owned (leak)"
        )
