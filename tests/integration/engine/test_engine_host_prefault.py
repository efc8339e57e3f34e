"""An idle engine faults in its host pool's memory a piece at a time (``HostPool.fault_in_more``
from the scheduler's wait for work), so that write-throughs later copy into resident memory
instead of paying the kernel's page faults beside the forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hicache.cache import hierarchical_cache
from hicache.engine.engine import Engine
from hicache.memory import host_pool as host_pool_module
from tests.engine_helpers import run
from tests.waiting import wait_until

# Guards against a hang, not a bound: the pool here is a few megabytes.
SETTLE_S = 60.0


def test_an_idle_engine_faults_in_its_host_pool_and_serves_alike(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    flags = ("--page-size", "16", "--max-total-tokens", "2048")
    flat = make_engine(*flags)
    expected = run(flat, ids, ignore_eos=True).token_ids
    # Nothing faulted in when the pool is made, one page at a time while idle.
    monkeypatch.setattr(host_pool_module, "PREFAULT_BYTES", 0)
    monkeypatch.setattr(hierarchical_cache, "IDLE_FAULT_BYTES", 1)
    engine = make_engine(*flags, "--enable-hierarchical-cache")
    pool = engine.cache.host_pool
    assert pool is not None and pool.num_pages > 1 and not pool.pinned
    assert wait_until(lambda: pool.faulted_pages == pool.num_pages, SETTLE_S), (
        pool.faulted_pages, pool.num_pages)
    assert engine.metrics()["host_pool_faulted_pages"] == pool.num_pages
    assert run(engine, ids, ignore_eos=True).token_ids == expected
