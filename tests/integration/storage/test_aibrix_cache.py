"""The aibrix L3 under the whole cache and the engine: KV and outputs equal to a cold run.

The cache tests go through the KV oracle (``tests.kv_oracle``): every page that
came back from AIBrix must equal what a cold prefill computes, bit for bit.
The engine test attaches the backend by name through the admin path a server
uses, and compares greedy tokens with a cold run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.engine.engine import Engine
from hicache.storage.frame import PayloadOrder, object_name
from tests.dev_dependency import require_dev_dependency
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.integration.storage.test_storage_e2e import GEOMETRY, PAGE_SIZE
from tests.l3_caches import assert_a_new_cache_reuses, l3_backend_of, make_l3_cache
from tests.l3_engine_checks import ENGINE_FLAGS, assert_hit_after_flush
from tests.unit.test_l3_cache import conversation, serve_with_l3, settle

require_dev_dependency("aibrix_kvcache", "pip install 'hicache[aibrix]' (see scripts/bootstrap.sh)")
rocksdict = require_dev_dependency("rocksdict", "pip install 'hicache[aibrix]'")

from hicache.storage.backends.aibrix.backend import AibrixBackend  # noqa: E402 - after the dependency check


def make_cache(root: Path, layout: MemLayout = MemLayout.PAGE_FIRST) -> HierarchicalCache:
    extra = {"path": str(root), "l1_capacity": "8MiB", "timeout_per_token_ms": 1000}
    cache = make_l3_cache("aibrix", extra, GEOMETRY, page_size=PAGE_SIZE, layout=layout)
    assert cache.storage is not None, cache.storage_error
    return cache


def backend_of(cache: HierarchicalCache) -> AibrixBackend:
    return l3_backend_of(cache, AibrixBackend)


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_a_new_instance_reuses_the_kv_the_last_one_stored(
    tmp_path: Path, layout: MemLayout
) -> None:
    # Closing the first cache closes AIBrix's manager and its RocksDB: the second one's
    # AIBrix L1 is new, so its hits come from RocksDB, then (after a flush) from that L1.
    assert_a_new_cache_reuses(lambda: make_cache(tmp_path, layout), conversation(40))


def test_a_corrupted_page_in_rocksdb_ends_the_reused_prefix(tmp_path: Path) -> None:
    tokens = conversation(40)
    first = make_cache(tmp_path)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        keys = first.tree.page_keys(first.tree.match_prefix(tokens).last_node)
        name = object_name(keys[5], PayloadOrder.TOKEN_MAJOR)
        directory = next(backend_of(first).store.rocksdb_root.rglob("CURRENT")).parent
    finally:
        first.close()
    access = rocksdict.AccessType.with_ttl(600)  # as AIBrix opens it
    db = rocksdict.Rdict(str(directory), rocksdict.Options(raw_mode=True), access_type=access)
    try:
        value = bytearray(db[name.encode()])
        value[7] ^= 0x40  # one bit of the payload
        db[name.encode()] = bytes(value)
    finally:
        db.close()

    second = make_cache(tmp_path)
    try:
        # Pages 0..4 are reused; page 5 fails its checksum (when the cache loads it),
        # so it and everything after it are recomputed (the oracle checks the KV
        # equals cold KV).
        assert serve_with_l3(second, tokens) == 20
        assert second.stats.num_corrupt_pages == 1
        settle(second)
        assert backend_of(second).stats().failures == {"corrupt": 1}  # discarded
        assert backend_of(second).stats().pages_written == 1  # the dropped page, again
    finally:
        second.close()


def test_the_engine_answers_as_cold_with_aibrix_attached_by_name(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(*ENGINE_FLAGS)
    extra = {
        "path": str(tmp_path), "l1_capacity": "64MiB", "prefetch_threshold": 64,
        "timeout_per_token_ms": 1000,
    }
    # The admin endpoint's path: by name, with the extra config a user would send.
    engine.attach_storage("aibrix", extra, "wait_complete")
    assert engine.storage_status()["backend"] == "aibrix"

    ids = prompt(21)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from AIBrix

    # Detached (AIBrix closed) and attached again: the pages come back from RocksDB.
    engine.detach_storage()
    engine.attach_storage("aibrix", extra, "wait_complete")
    assert_hit_after_flush(engine, ids, cold.token_ids)
    engine.check_integrity()
