"""The file store's core set (``core_fraction``, ``eviction_order``) on real files: a
loop larger than the cap hits every round where LRU never does, and what it reads is
what was written; the set is marked in the files, so a restart and another instance
sharing the directory keep it; a bad setting is refused by name."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import CORE_MODE_BIT, FileBackend
from hicache.storage.base import StorageError
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from tests.file_opener import FileOpener, host_maker, opened
from tests.storage_contract import as_bytes, fill_random, page_bytes_of

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4
FILE_BYTES = HEADER_BYTES + GEOMETRY.page_bytes(PAGE_SIZE)
NAMESPACE = KeyNamespace("file-core-tests", GEOMETRY.describe(), PAGE_SIZE)
CAP = 8 * FILE_BYTES  # with the default share, a core set of 6 pages
LOOP = 12  # pages reused in turn: 1.5x the cap
READ_AT = 40  # host pages reads land in


def ids(start: int, stop: int) -> PageIds:
    return np.arange(start, stop, dtype=np.int64)


def keys_of(count: int, seed: int = 0) -> list[bytes]:
    # One-page chains: every key its own prefix, as many small conversations.
    rng = np.random.default_rng(seed)
    return [
        chain_page_keys(pack_tokens(rng.integers(0, 32000, PAGE_SIZE)), PAGE_SIZE,
                        NAMESPACE.seed())[0]
        for _ in range(count)
    ]


def file_of(root: Path, key: bytes) -> Path:
    name = object_name(key, PayloadOrder.TOKEN_MAJOR)
    return root / name[:2] / name


Opener = FileOpener


make_host = host_maker(GEOMETRY, PAGE_SIZE, 64)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def open_file(root: Path) -> Iterator[Opener]:
    yield from opened(root, make_host, max_bytes=CAP)


class Loop:
    """Pages used in turn, each read when stored and written when not (a miss computed
    again); checks every page read against what was written."""

    def __init__(self, host: HostPool, keys: list[bytes]) -> None:
        self.keys = keys
        self.values = [fill_random(host, ids(index, index + 1), seed=index)
                       for index in range(len(keys))]

    def round(self, backend: FileBackend, host: HostPool) -> int:
        hits = 0
        for index, key in enumerate(self.keys):
            if backend.exists([key]) and backend.get([key], ids(READ_AT, READ_AT + 1)) == 1:
                assert page_bytes_of(host, ids(READ_AT, READ_AT + 1)) == as_bytes(
                    self.values[index]
                )
                hits += 1
            else:
                assert backend.set([key], ids(index, index + 1)) == 1
        backend.check_integrity()
        return hits


def one_round(open_file: Opener) -> tuple[FileBackend, HostPool, list[bytes], Loop]:
    """A store that has seen one round of the loop: its first six pages in the core set."""
    backend, host = open_file()
    keys = keys_of(LOOP)
    loop = Loop(host, keys)
    loop.round(backend, host)
    return backend, host, keys, loop


def write_once(backend: FileBackend, host: HostPool, count: int) -> None:
    """Write ``count`` pages used once (the loop's are seeded 0, these 1)."""
    fill_random(host, ids(0, count), seed=99)
    for index, key in enumerate(keys_of(count, seed=1)):
        assert backend.set([key], ids(index, index + 1)) == 1


def test_a_loop_larger_than_the_cap_hits_every_round_where_lru_never_does(
    tmp_path: Path,
) -> None:
    hits: dict[float, list[int]] = {}
    for share in (0.0, 0.75):
        opener = FileOpener(tmp_path / f"l3-{share}", make_host, max_bytes=CAP)
        backend, host = opener(core_fraction=share)
        loop = Loop(host, keys_of(LOOP))
        hits[share] = [loop.round(backend, host) for _ in range(5)]
        assert backend.total_bytes <= CAP
        backend.close()
    assert hits[0.0] == [0] * 5
    assert hits[0.75] == [0] + [6] * 4


def test_the_core_set_is_marked_in_the_files_and_a_restart_keeps_it(
    root: Path, open_file: Opener
) -> None:
    first, _, keys, _ = one_round(open_file)
    marked = [bool(os.stat(file_of(root, key)).st_mode & CORE_MODE_BIT)
              for key in keys if file_of(root, key).exists()]
    assert marked == [True] * 6 + [False] * 2  # the first six joined; two churn outside
    first.close()
    restarted, restarted_host = open_file()
    # Pages written once after the restart churn outside the set it found on disk.
    write_once(restarted, restarted_host, 4)
    again = Loop(restarted_host, keys)
    assert [again.round(restarted, restarted_host) for _ in range(3)] == [6, 6, 6]


def test_another_instance_sharing_the_directory_keeps_the_core_set(
    root: Path, open_file: Opener
) -> None:
    first, host, keys, loop = one_round(open_file)
    # A second instance writes pages of its own past the cap: it finds the first's core
    # pages in its scan and evicts outside the set.
    second, other_host = open_file()
    write_once(second, other_host, 8)
    second.check_integrity()
    assert [file_of(root, key).exists() for key in keys[:6]] == [True] * 6
    assert loop.round(first, host) == 6


def test_pages_read_again_displace_a_core_set_gone_stale(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file()
    old = Loop(host, keys_of(LOOP))
    old.round(backend, host)
    # A new working set that fits the cap, used over and over: it takes the core set.
    new = Loop(host, keys_of(6, seed=5))
    rounds = [new.round(backend, host) for _ in range(4)]
    assert rounds[0] == 0 and rounds[-1] == 6
    assert [bool(os.stat(file_of(root, key)).st_mode & CORE_MODE_BIT)
            for key in new.keys] == [True] * 6


@pytest.mark.parametrize(
    ("value", "message"),
    [(1.0, "core_fraction must be below 1"), (-0.5, "core_fraction must be a number >= 0")],
)
def test_a_bad_core_fraction_is_refused_by_name(value: float, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        FileBackend({"core_fraction": value})
