"""The file L3 under the whole cache: KV written by one instance is reused, bit for bit, by
the next one over the same directory, and a damaged page only shortens what is reused.

Requests go through the KV oracle (``tests.kv_oracle.serve``): every reused page
must equal what a cold prefill computes, and every pool must pass its
integrity check after each step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.storage.file import FileBackend
from hicache.storage.frame import PayloadOrder, object_name
from tests.l3_caches import assert_a_new_cache_reuses, l3_backend_of, make_l3_cache
from tests.unit.test_l3_cache import conversation, serve_with_l3, settle

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
PAGE_SIZE = 4


def make_cache(root: Path, layout: MemLayout = MemLayout.PAGE_FIRST) -> HierarchicalCache:
    cache = make_l3_cache("file", {"path": str(root)}, GEOMETRY, page_size=PAGE_SIZE, layout=layout)
    backend_of(cache)  # it attached, and is the file backend
    return cache


def backend_of(cache: HierarchicalCache) -> FileBackend:
    return l3_backend_of(cache, FileBackend)


def page_file(cache: HierarchicalCache, root: Path, tokens: list[int], page: int) -> Path:
    keys = cache.tree.page_keys(cache.tree.match_prefix(tokens).last_node)
    order = PayloadOrder.of_layout(cache.config.mem_layout)
    name = object_name(keys[page], order)
    return root / name[:2] / name


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_new_instance_reuses_the_kv_the_last_one_stored(
    tmp_path: Path, layout: MemLayout
) -> None:
    assert_a_new_cache_reuses(lambda: make_cache(tmp_path, layout), conversation(40))


def test_a_corrupted_page_file_ends_the_reused_prefix(tmp_path: Path) -> None:
    tokens = conversation(40)
    first = make_cache(tmp_path)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        damaged = page_file(first, tmp_path, tokens, 5)
    finally:
        first.close()
    data = bytearray(damaged.read_bytes())
    data[7] ^= 0x40  # one bit of the payload
    damaged.write_bytes(bytes(data))

    second = make_cache(tmp_path)
    try:
        # Pages 0..4 are reused; page 5 fails its checksum, so it and everything
        # after it are recomputed. serve() checks the KV equals cold KV.
        assert serve_with_l3(second, tokens) == 20
        assert backend_of(second).stats().failures == {"corrupt": 1}
        settle(second)
        # The bad file was dropped and the recomputed pages were backed up again.
        assert damaged.exists()
        assert backend_of(second).stats().pages_written == 1
    finally:
        second.close()

    third = make_cache(tmp_path)
    try:
        assert serve_with_l3(third, tokens) == 40
        settle(third)
    finally:
        third.close()


def test_a_page_file_removed_after_the_lookup_is_a_miss_not_an_error(tmp_path: Path) -> None:
    tokens = conversation(48)
    first = make_cache(tmp_path)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        gone = page_file(first, tmp_path, tokens, 3)
    finally:
        first.close()
    second = make_cache(tmp_path)
    try:
        # The new instance indexed every file at start-up; one disappears before the read.
        assert backend_of(second).exists([bytes.fromhex(gone.name[:32])]) == 1
        gone.unlink()
        assert serve_with_l3(second, tokens) == 12
        assert backend_of(second).stats().failures == {"missing": 1}
        settle(second)
    finally:
        second.close()
