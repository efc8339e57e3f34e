"""The purge_tenant cache operation on a real cache (L1 + L2, an in-memory L3 whose
controller's tenant purge is a stand-in): the tenant's pages are freed in both pools and
the other tenant's stay, its pins released (another tenant's kept); L3 is purged only on
the pass that asks for it; a store that cannot purge, or no store at all, is an
``l3_error`` while L1 and L2 are purged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind
from hicache.engine.api import Hint, HintKind, HintOutcomeKind
from hicache.engine.cache_ops import purge_tenant, purge_tenant_l3_done, wait_l3_purge
from hicache.memory.geometry import KVGeometry
from hicache.storage.config import StorageConfig
from hicache.storage.controller import PurgeOp
from tests.kv_oracle import conversation, expected_kv, settle
from tests.storage_reference import MemoryBackend, MemoryStore

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 2


class FakePurge:
    """The controller's ``submit_purge``: a queued purge that ends when ``finish`` says
    (at once with ``immediate``), removing 5 objects or failing with ``error``."""

    def __init__(self, error: str | None = None, immediate: bool = True) -> None:
        self.error = error
        self.immediate = immediate
        self.calls: list[tuple[str | None, float]] = []
        self.ops: list[PurgeOp] = []

    def __call__(self, tenant: str | None, timeout_s: float) -> PurgeOp:
        self.calls.append((tenant, timeout_s))
        op = PurgeOp(tenant, time.monotonic() + timeout_s)
        self.ops.append(op)
        if self.immediate:
            self.finish(op)
        return op

    def finish(self, op: PurgeOp) -> None:
        if self.error is not None:
            op.error = self.error
        else:
            op.removed = 5
        op.done.set()


@pytest.fixture
def cache() -> Iterator[HierarchicalCache]:
    config = CacheConfig(page_size=PAGE, enable_hierarchical_cache=True,
                         io_backend=IOBackendKind.DIRECT, load_back_threshold_tokens=1)
    built = HierarchicalCache(config, GEOMETRY, 32, host_num_pages=80)
    try:
        yield built
    finally:
        built.close()


def fill(cache: HierarchicalCache, tokens: list[int], tenant: str | None) -> None:
    pages = cache.alloc_device(len(tokens) // PAGE)
    cache.device_pool.pages[torch.from_numpy(pages)] = expected_kv(tokens, GEOMETRY, PAGE)
    cache.insert(tokens, np.asarray(pages), tenant)
    settle(cache)


def host(cache: HierarchicalCache) -> SimpleNamespace:
    return SimpleNamespace(cache=cache, is_idle=lambda: True)


def attach(cache: HierarchicalCache, fake: FakePurge) -> None:
    cache.attach_storage(StorageConfig(backend="memory"), MemoryBackend(MemoryStore()))
    assert cache.storage is not None
    setattr(cache.storage.controller, "submit_purge", fake)  # noqa: B010


def purge_all(cache: HierarchicalCache, tenant: str | None,
              l3_timeout_s: float | None) -> dict[str, object]:
    """What the engine does: a pass (the scheduler's), then the wait for L3 (its own)."""
    out = purge_tenant(host(cache), tenant, l3_timeout_s)  # type: ignore[arg-type]
    if l3_timeout_s is not None:
        out["l3_objects"], out["l3_error"] = wait_l3_purge(
            cache, out, l3_timeout_s,
            lambda purge_id, purged: purge_tenant_l3_done(
                host(cache), purge_id, purged),  # type: ignore[arg-type]
        )
    return out


def test_purge_frees_the_tenants_pages_and_keeps_the_others(cache: HierarchicalCache) -> None:
    fill(cache, conversation(8, seed=1), "a")
    fill(cache, conversation(8, seed=2), "b")
    device_free = cache.device_pool.allocator.num_free_pages
    out = purge_tenant(host(cache), "a", None)  # type: ignore[arg-type]
    assert out == {"device_pages": 4, "host_pages": 4, "kept_device_pages": 0,
                   "kept_host_pages": 0}  # no L3 pass asked
    assert cache.device_pool.allocator.num_free_pages == device_free + 4
    assert cache.tree.device_pages_by_tenant == {"b": 4}
    assert cache.tree.host_pages_by_tenant == {"b": 4}
    cache.check_integrity()


def test_the_l3_pass_purges_the_store(cache: HierarchicalCache) -> None:
    fake = FakePurge()
    attach(cache, fake)
    fill(cache, conversation(8, seed=1), "a")
    out = purge_all(cache, "a", 7.5)
    assert (out["l3_objects"], out["l3_error"]) == (5, None)
    assert fake.calls == [("a", 7.5)]
    cache.check_integrity()


def test_a_store_that_cannot_purge_is_an_l3_error(cache: HierarchicalCache) -> None:
    attach(cache, FakePurge(error="the store cannot list its objects"))
    fill(cache, conversation(8, seed=1), "a")
    out = purge_all(cache, "a", 1.0)
    assert out["l3_objects"] is None
    assert out["l3_error"] == "the store cannot list its objects"
    assert out["device_pages"] == 4  # L1 and L2 are purged all the same
    cache.check_integrity()


def test_without_l3_the_l3_pass_says_so(cache: HierarchicalCache) -> None:
    fill(cache, conversation(8, seed=1), None)
    out = purge_all(cache, None, 1.0)
    assert out["l3_objects"] is None and "no L3" in str(out["l3_error"])
    assert out["device_pages"] == 4
    cache.check_integrity()


def test_purge_releases_the_tenants_pins_and_keeps_anothers(cache: HierarchicalCache) -> None:
    mine, theirs = conversation(8, seed=1), conversation(8, seed=2)
    fill(cache, mine, "a")
    fill(cache, theirs, "b")
    outcomes = cache.hints.apply([
        Hint(HintKind.PIN, tuple(mine), ttl_s=60.0, tenant="ta", extra_key="a"),
        Hint(HintKind.PIN, tuple(theirs), ttl_s=60.0, tenant="tb", extra_key="b"),
    ])
    assert [o.outcome for o in outcomes] == [HintOutcomeKind.ACCEPTED] * 2
    assert cache.tree.num_pinned_pages == 8
    out = purge_tenant(host(cache), "a", None)  # type: ignore[arg-type]
    assert (out["device_pages"], out["kept_device_pages"], out["kept_host_pages"]) == (4, 0, 0)
    assert cache.tree.num_pinned_pages == 4  # b's pin stands
    assert cache.hints.status()["pinned_pages_by_tenant"] == {"tb": 4}
    cache.check_integrity()


def test_the_scheduler_pass_only_queues_the_l3_purge(cache: HierarchicalCache) -> None:
    # A store's purge can take as long as its timeout: the scheduler thread's pass
    # returns before it ends, and the caller's wait sees it through.
    fake = FakePurge(immediate=False)
    attach(cache, fake)
    fill(cache, conversation(8, seed=1), "a")
    out = purge_tenant(host(cache), "a", 30.0)  # type: ignore[arg-type]
    op = out["l3_purge"]
    assert isinstance(op, PurgeOp) and not op.done.is_set()
    assert out["device_pages"] == 4 and out["l3_error"] is None
    assert id(op) in cache._l3_purges  # the removed nodes wait for the purge's end
    fake.finish(op)
    done: list[tuple[int, bool]] = []
    result = wait_l3_purge(cache, out, 30.0, lambda i, ok: done.append((i, ok)))
    assert result == (5, None) and done == [(id(op), True)]
    purge_tenant_l3_done(host(cache), id(op), True)  # type: ignore[arg-type]
    assert not cache._l3_purges
    cache.check_integrity()
