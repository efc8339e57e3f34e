"""Control operations that change the cache, run on the scheduler thread between steps.

They are named (``CACHE_OPS``) rather than passed as closures so that, under tensor
parallelism, rank 0 can tell every rank to run the same one at the same point of the
same tick (``engine/replication.py``): each rank's cache must change alike. Every
operation is a function of its ``CacheHost`` (the scheduler: its cache, and whether
it is idle) and of the plain, picklable arguments its caller gave (the same on every
rank); its result is what rank 0's caller gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from hicache.cache.drain import DrainProgress, L3Drain, pages_lacking
from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.cache.warm import L3Warm
from hicache.engine.api import Hint, HintOutcome
from hicache.storage.base import StorageError
from hicache.storage.controller import PurgeOp, StorageMetrics


class CacheHost(Protocol):
    """What a cache operation sees of the scheduler."""

    @property
    def cache(self) -> HierarchicalCache: ...

    def is_idle(self) -> bool:
        """No request queued, running or held by a disaggregation hook."""


def flush(host: CacheHost) -> bool:
    """Forget every cached prefix in L1 and L2; False (and nothing done) when busy."""
    if not host.is_idle():
        return False
    host.cache.flush()
    return True


def check_integrity(host: CacheHost) -> None:
    """Assert the tree and every pool are consistent and nothing leaked (when idle)."""
    if not host.is_idle():
        raise RuntimeError("check_integrity needs an idle engine")
    host.cache.poll(wait=True)
    host.cache.check_integrity()


def evict_device_cache(host: CacheHost) -> int:
    """Push every cached page no request holds out of L1 (host copies stay in L2);
    returns the number of device pages freed."""
    cache = host.cache
    cache.poll(wait=True)  # copies in flight keep their pages locked
    allocator = cache.device_pool.allocator
    before = allocator.num_free_pages
    pages = cache.alloc_device(before + cache.tree.num_evictable_device_pages)
    cache.free_device(pages)
    return allocator.num_free_pages - before


def detach_storage(host: CacheHost) -> None:
    """Drain in-flight L3 work and detach the L3 tier (only when idle). Under tensor
    parallelism every rank detaches at the same tick, and what a call stalled on one
    rank still holds is released when the ranks agree (``cache/l3_agreement.py``)."""
    if not host.is_idle():
        raise StorageError("requests are running: detach L3 only when the server is idle")
    host.cache.detach_storage()


def clear_storage(host: CacheHost) -> None:
    """Remove every page of the attached L3 store (only when idle; L1 and L2 stay). Under
    tensor parallelism every rank clears its store at the same tick (where the ranks
    share one store, the later clears find it empty)."""
    if not host.is_idle():
        raise StorageError("requests are running: clear L3 only when the server is idle")
    host.cache.clear_storage()


def drain_l3_step(host: CacheHost) -> dict[str, Any]:
    """One step of writing what L3 lacks of L1 and L2 to L3, hottest first
    (``cache/drain.py``): the first call plans the drain, each issues what it can; the
    caller steps until ``done`` or its deadline. Returns ``DrainProgress.as_dict()``."""
    cache = host.cache
    if cache.storage is None:
        return DrainProgress(done=True, l3_attached=False).as_dict()
    if cache.l3_drain is None:
        cache.l3_drain = L3Drain(cache)
    return cache.l3_drain.step().as_dict()


def l3_lacking_pages(host: CacheHost) -> int:
    """Pages in L1 or L2 that L3 lacks as far as this worker knows (0 without L3)."""
    return 0 if host.cache.storage is None else pages_lacking(host.cache)


def warm_start(
    host: CacheHost, warm_id: str, items: list[list[int]], max_host_fraction: float
) -> dict[str, Any]:
    """Start warming the host tier from L3 with the prefixes ``items`` (``cache/warm.py``)
    within ``max_host_fraction`` of the host pool; the caller steps ``warm_step`` until
    ``done``, or ends it with ``warm_stop``. Returns ``L3Warm.progress()``."""
    cache = host.cache
    if warm_id in cache.l3_warms:
        raise ValueError(f"warm {warm_id!r} is already running")
    warm = L3Warm(cache, items, max_host_fraction)
    cache.l3_warms[warm_id] = warm
    return _warm_step(cache, warm_id)


def warm_step(host: CacheHost, warm_id: str) -> dict[str, Any]:
    """Settle the warm's done prefetches and start those that fit; forgotten once done."""
    return _warm_step(host.cache, warm_id)


def warm_stop(host: CacheHost, warm_id: str) -> dict[str, Any]:
    """End the warm now, keeping what landed (the caller's deadline)."""
    warm = host.cache.l3_warms.pop(warm_id, None)
    return {"done": True, "results": []} if warm is None else warm.stop()


def _warm_step(cache: HierarchicalCache, warm_id: str) -> dict[str, Any]:
    warm = cache.l3_warms.get(warm_id)
    if warm is None:
        return {"done": True, "results": []}
    progress = warm.step()
    if warm.done:
        del cache.l3_warms[warm_id]
    return progress


def purge_tenant(host: CacheHost, tenant: str | None, l3_timeout_s: float | None) -> dict[str, Any]:
    """Remove ``tenant``'s pages from L1 and L2 (``HierarchicalCache.purge_tenant``), and,
    with ``l3_timeout_s``, queue the removal of its L3 objects (``begin_purge_tenant_l3``).
    Runs while requests run: what one still holds is left and counted (``kept_*``); the
    engine aborts the tenant's requests first and calls again until nothing is kept or
    its deadline passes, and only then purges L3, so that no backup in flight writes the
    tenant back to L3 after its purge. The L3 purge runs on the store's write thread and
    the engine waits for it off this thread (``l3_purge``: the queued purge, on rank 0 the
    object itself), then calls ``purge_tenant_l3_done``: a store however slow never holds
    the scheduler. Publishes the KV events at once (the engine may be idle)."""
    cache = host.cache
    removal = cache.purge_tenant(tenant)
    out: dict[str, Any] = {
        "device_pages": len(removal.device_pages),
        "host_pages": len(removal.host_pages),
        "kept_device_pages": removal.kept_device_pages,
        "kept_host_pages": removal.kept_host_pages,
    }
    if l3_timeout_s is not None:
        out["l3_purge"], out["l3_error"] = cache.begin_purge_tenant_l3(tenant, l3_timeout_s)
    cache.publish_events()
    return out


def wait_l3_purge(
    cache: HierarchicalCache, out: dict[str, Any], timeout_s: float,
    done: Callable[[int, bool], object],
) -> tuple[int | None, str | None]:
    """On the caller's thread (never the scheduler's): wait for the L3 purge a
    ``purge_tenant`` pass queued (``out``, its answer), then ``done(purge_id, purged)``
    runs ``purge_tenant_l3_done`` on the scheduler. (objects removed, None) or (None,
    why not)."""
    op: PurgeOp | None = out.get("l3_purge")
    error: str | None = out.get("l3_error")
    if op is None:  # not queued: no L3, it could not, or another rank purges it
        return (None, error) if error is not None else (0, None)
    assert cache.storage is not None  # it queued the purge
    try:
        removed: int | None = cache.storage.controller.wait_purge(op, timeout_s)
    except StorageError as failure:
        removed, error = None, str(failure)
    done(id(op), removed is not None)
    return removed, error


def purge_tenant_l3_done(host: CacheHost, purge_id: int, purged: bool) -> None:
    """An L3 purge ``purge_tenant`` queued is over (``finish_purge_tenant_l3``): its KV
    events (the pages gone from L3) go out at once."""
    host.cache.finish_purge_tenant_l3(purge_id, purged)
    host.cache.publish_events()


def hints_apply(host: CacheHost, hints: list[Hint]) -> list[HintOutcome]:
    """Apply ``hints`` (``cache/hints.py``): one outcome each, in order. Each names its
    prefix (a hint without ``input_ids`` is rejected here: only a request has its own)."""
    return host.cache.hints.apply(hints)


def hint_status(host: CacheHost) -> dict[str, Any]:
    """What hints hold: pinned and retained pages, budgets, records, outcome counts."""
    return host.cache.hints.status()


CACHE_OPS: dict[str, Callable[..., Any]] = {
    "flush": flush,
    "check_integrity": check_integrity,
    "evict_device_cache": evict_device_cache,
    "detach_storage": detach_storage,
    "clear_storage": clear_storage,
    "drain_l3_step": drain_l3_step,
    "l3_lacking_pages": l3_lacking_pages,
    "warm_start": warm_start,
    "warm_step": warm_step,
    "warm_stop": warm_stop,
    "hints_apply": hints_apply,
    "hint_status": hint_status,
    "purge_tenant": purge_tenant,
    "purge_tenant_l3_done": purge_tenant_l3_done,
}


def l3_metrics(host: CacheHost) -> tuple[StorageMetrics, dict[str, int]] | None:
    """This rank's L3 counters and its backend's failures (None without L3)."""
    storage = host.cache.storage
    if storage is None:
        return None
    return storage.metrics(), storage.controller.backend_failures()


# Reads that every rank answers about its own cache, gathered to rank 0 in rank order
# (``Scheduler.gather``): what each rank alone knows, as its L3 store's counters. They
# change nothing, but under tensor parallelism their gather is a collective, so they
# are broadcast like the operations above and run at the same point of the same tick.
RANK_READS: dict[str, Callable[[CacheHost], Any]] = {
    "l3_metrics": l3_metrics,
}
