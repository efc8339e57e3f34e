"""The file L3 under the whole cache: KV written by one instance is reused, bit for bit, by
the next one over the same directory, and a damaged page only shortens what is reused.

Requests go through the KV oracle (``tests.kv_oracle.serve``): every reused page
must equal what a cold prefill computes, and every pool must pass its
integrity check after each step.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.storage import page_regions
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.frame import Buffer, PayloadOrder, object_name
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


@pytest.mark.parametrize("bad_page", [0, 5, 9])
def test_a_corrupted_page_file_ends_the_reused_prefix(tmp_path: Path, bad_page: int) -> None:
    tokens = conversation(40)
    first = make_cache(tmp_path)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        damaged = page_file(first, tmp_path, tokens, bad_page)
    finally:
        first.close()
    data = bytearray(damaged.read_bytes())
    data[7] ^= 0x40  # one bit of the payload
    damaged.write_bytes(bytes(data))

    second = make_cache(tmp_path)
    try:
        # The pages before the bad one are reused; it fails its checksum (when the
        # cache loads it), so it and everything after it are recomputed. serve()
        # checks the KV equals cold KV.
        assert serve_with_l3(second, tokens) == bad_page * PAGE_SIZE
        assert second.stats.num_corrupt_pages == 1
        settle(second)
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


def test_pages_are_hashed_in_the_caches_copies_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU device the L3 put takes the checksum the write took while copying each
    page in, and the get leaves the payload check to the load: neither hashes a page."""
    hashed: list[int] = []
    real = page_regions.checksum

    def counting(fragments: Iterable[Buffer]) -> bytes:
        hashed.append(1)
        return real(fragments)

    monkeypatch.setattr(page_regions, "checksum", counting)
    tokens = conversation(40)
    first = make_cache(tmp_path)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        assert backend_of(first).stats().pages_written == 10
    finally:
        first.close()
    second = make_cache(tmp_path)
    try:
        assert serve_with_l3(second, tokens) == 40
        assert second.stats.num_corrupt_pages == 0
        assert backend_of(second).stats().pages_read == 10
        host = second.host_pool
        assert host is not None and host.digests.defer_checks
        pages = second.tree.match_prefix(tokens).host_pages
        assert len(pages) == 0  # loaded: on the device now, their host copies verified
    finally:
        second.close()
    assert hashed == []


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
