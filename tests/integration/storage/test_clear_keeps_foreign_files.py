"""Clearing a file or nixl store removes our pages and nothing else.

Real backends over a temporary directory store a few pages; beside them sit
files these backends never wrote but that have a page's name: random bytes, a
copy of one of our pages under another page's name (its header names another
key), our page's bytes with something appended, and a symlink to one of our
pages. ``clear`` removes every page we wrote and leaves each of those alone.
Before, any file with a page-shaped name went.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageBackend
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, encode_header, object_name
from hicache.storage.page_files import holds_our_page
from tests.storage_contract import fill_random

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4
PAGE_BYTES = GEOMETRY.page_bytes(PAGE_SIZE)
ORDER = PayloadOrder.TOKEN_MAJOR  # page_first


def _keys(count: int, seed: int) -> list[bytes]:
    namespace = KeyNamespace("clear-tests", GEOMETRY.describe(), PAGE_SIZE)
    tokens = np.random.default_rng(seed).integers(0, 32000, count * PAGE_SIZE)
    return chain_page_keys(pack_tokens(tokens), PAGE_SIZE, namespace.seed())


def _path(root: Path, key: bytes) -> Path:
    name = object_name(key, ORDER)
    return root / name[:2] / name


def _file_backend(root: Path) -> StorageBackend:
    return FileBackend({"path": str(root)})


def _nixl_backend(root: Path) -> StorageBackend:
    from tests.nixl_fixtures import require_nixl

    require_nixl()
    from hicache.storage.backends.nixl.backend import NixlBackend

    return NixlBackend({"path": str(root)})


@pytest.mark.parametrize("make", [_file_backend, _nixl_backend], ids=["file", "nixl"])
def test_clear_removes_our_pages_and_leaves_look_alikes(
    tmp_path: Path, make: Callable[[Path], StorageBackend]
) -> None:
    root = tmp_path / "l3"
    backend = make(root)
    host = HostPool(GEOMETRY, 8, PAGE_SIZE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend.attach(host)
    try:
        ours = _keys(3, seed=1)
        fill_random(host, np.arange(3), seed=3)
        assert backend.set(ours, np.arange(3)) == 3
        assert all(holds_our_page(str(_path(root, k)), _path(root, k).name) for k in ours)

        strangers = _keys(4, seed=2)
        foreign: dict[str, Path] = {}
        for label, key in zip(("random", "copied", "appended", "link"), strangers, strict=True):
            foreign[label] = _path(root, key)
            foreign[label].parent.mkdir(parents=True, exist_ok=True)
        foreign["random"].write_bytes(os.urandom(PAGE_BYTES + HEADER_BYTES))
        shutil.copyfile(_path(root, ours[0]), foreign["copied"])  # names another key
        foreign["appended"].write_bytes(_path(root, ours[1]).read_bytes() + b"tail")
        outside = tmp_path / "elsewhere.page"
        shutil.copyfile(_path(root, ours[2]), outside)
        foreign["link"].symlink_to(outside)

        backend.clear()

        assert not any(_path(root, k).exists() for k in ours)
        assert all(path.exists() or path.is_symlink() for path in foreign.values()), {
            label: path.exists() for label, path in foreign.items()}
        assert outside.exists()
        assert backend.exists(ours) == 0
    finally:
        backend.close()


def test_holds_our_page_knows_both_trailer_sizes(tmp_path: Path) -> None:
    key = _keys(1, seed=4)[0]
    name = object_name(key, ORDER)
    payload = os.urandom(PAGE_BYTES)
    header = encode_header(key, ORDER, PAGE_BYTES, b"\0" * 16)
    buffered, direct = tmp_path / "buffered", tmp_path / "direct"
    buffered.mkdir()
    direct.mkdir()
    (buffered / name).write_bytes(payload + header)
    (direct / name).write_bytes(payload + header + b"\0" * (4096 - HEADER_BYTES))
    assert holds_our_page(str(buffered / name), name)
    assert holds_our_page(str(direct / name), name)
    wrong_order = object_name(key, PayloadOrder.LAYER_MAJOR)  # the header says otherwise
    (buffered / wrong_order).write_bytes(payload + header)
    assert not holds_our_page(str(buffered / wrong_order), wrong_order)
    assert not holds_our_page(str(buffered / "missing"), name)
    (buffered / "short").write_bytes(header[:10])
    assert not holds_our_page(str(buffered / "short"), name)
