"""The nixl L3 under the whole cache and the engine: what comes back equals a cold run.

The cache tests go through the KV oracle (``tests.kv_oracle``): every page reused
from the files must equal, bit for bit, what a cold prefill computes. The
engine test compares greedy tokens with a cold run, and re-attaches the
backend by name through the engine's admin path (detach, then attach), as
``/hicache/storage-backend`` does.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.engine.engine import Engine
from hicache.memory.geometry import KVGeometry
from hicache.storage.breaker import BreakerState
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.l3_caches import assert_a_new_cache_reuses, l3_backend_of, make_l3_cache
from tests.l3_engine_checks import assert_hit_after_flush, l3_engine_flags
from tests.nixl_fixtures import require_nixl

require_nixl()

from hicache.storage.backends.nixl.backend import NixlBackend  # noqa: E402

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
# O_DIRECT needs 4096-byte page regions: 8 tokens x 2 heads x 128 x bf16 = 4096 bytes.
ALIGNED_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)


def make_cache(
    root: Path, layout: MemLayout, geometry: KVGeometry = GEOMETRY, page_size: int = 4,
    breaker_failures: int = 3, **extra: Any,
) -> HierarchicalCache:
    cache = make_l3_cache(
        "nixl", {"path": str(root), **extra}, geometry, page_size=page_size, layout=layout,
        breaker_failures=breaker_failures,
    )
    l3_backend_of(cache, NixlBackend)  # it attached, and is NIXL
    return cache


def reuse_across_instances(
    root: Path, layout: MemLayout, num_tokens: int, **cache_args: Any
) -> None:
    """One instance stores a conversation's KV; a fresh one reuses all of it, equal to cold."""
    assert_a_new_cache_reuses(
        lambda: make_cache(root, layout, **cache_args), conversation(num_tokens)
    )


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_new_cache_reuses_the_kv_stored_through_nixl(tmp_path: Path, layout: MemLayout) -> None:
    reuse_across_instances(tmp_path, layout, 40)


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_the_same_with_direct_io(tmp_path: Path, layout: MemLayout) -> None:
    reuse_across_instances(
        tmp_path, layout, 32, geometry=ALIGNED_GEOMETRY, page_size=8, direct_io=True
    )


def test_a_directory_that_breaks_under_the_cache_opens_the_breaker_and_serves_cold(
    tmp_path: Path,
) -> None:
    root = tmp_path / "l3"
    cache = make_cache(root, MemLayout.PAGE_FIRST, breaker_failures=2)
    try:
        stored = conversation(40)
        assert serve_with_l3(cache, stored) == 0
        settle(cache)
        shutil.rmtree(root)
        root.write_bytes(b"the store is gone")
        for seed in (1, 2, 3):  # new KV to back up: each backup fails in the backend
            assert serve_with_l3(cache, conversation(40, seed=seed)) == 0  # equal to cold
            settle(cache)
        assert cache.storage is not None
        assert cache.storage.backend.stats().failures.get("io_error", 0) >= 2
        assert cache.storage.controller.breaker.state is BreakerState.OPEN
        cache.flush()
        assert serve_with_l3(cache, stored) == 0  # not in L3 any more: recomputed, as cold
    finally:
        cache.close()


def test_engine_outputs_from_nixl_equal_cold_and_survive_detach_and_attach(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    extra = {"path": str(tmp_path / "l3")}
    engine = make_engine(*l3_engine_flags("nixl", extra))
    assert engine.cache.storage is not None, engine.cache.storage_error
    assert isinstance(engine.cache.storage.backend, NixlBackend)

    ids = prompt(21)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from the files

    engine.detach_storage()
    assert engine.storage_status()["attached"] is False
    assert engine.flush_cache()
    alone = run(engine, ids, ignore_eos=True)
    assert alone.last.cached_tokens.total == 0 and alone.token_ids == cold.token_ids

    engine.attach_storage("nixl", {**extra, "io_queue": "uring"}, "wait_complete")
    status = engine.storage_status()
    assert status["attached"] is True and status["backend"] == "nixl"
    assert_hit_after_flush(engine, ids, cold.token_ids)  # the files outlived the detach
    engine.check_integrity()
