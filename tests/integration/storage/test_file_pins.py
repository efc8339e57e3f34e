"""L3 pins in the file store: a pinned page outlives any eviction (the cap, a full
file system) in every instance sharing the directory and across restarts, until its
pin expires or is removed; pins only ever fill the cap up to refusing new pages.
And the storage controller's pin/unpin, queued on its write thread.

Real files in a temporary directory.
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.dynamic.backend import DynamicBackend
from hicache.storage.backends.file import backend as file_backend
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.file.pins import PINS_DIR
from hicache.storage.backends.throttled.backend import ThrottledBackend
from hicache.storage.base import StorageBackend, StorageError
from hicache.storage.breaker import CircuitBreaker
from hicache.storage.controller import StorageController
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from tests.file_opener import FileOpener, host_maker, opened
from tests.storage_contract import as_bytes, fill_random, page_bytes_of
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4
FILE_BYTES = HEADER_BYTES + GEOMETRY.page_bytes(PAGE_SIZE)
NAMESPACE = KeyNamespace("file-pin-tests", GEOMETRY.describe(), PAGE_SIZE)
CAP = 4 * FILE_BYTES
FAR = time.time() + 3600.0


def chain(count: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 32000, count * PAGE_SIZE)
    return chain_page_keys(pack_tokens(tokens), PAGE_SIZE, NAMESPACE.seed())


def ids(start: int, stop: int) -> PageIds:
    return np.arange(start, stop, dtype=np.int64)


Opener = FileOpener


make_host = host_maker(GEOMETRY, PAGE_SIZE, 64)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def open_file(root: Path) -> Iterator[Opener]:
    # Least-recently-used order: a storm of pages written once must reach the pages whose
    # pin ended (with the core set, pages never used again do not displace it).
    yield from opened(root, make_host, max_bytes=CAP, core_fraction=0)


def on_disk(root: Path, key: bytes) -> bool:
    name = object_name(key, PayloadOrder.TOKEN_MAJOR)
    return (root / name[:2] / name).is_file()


def storm(backend: FileBackend, count: int, seed: int) -> None:
    """Write ``count`` new pages one at a time: many times the cap's worth of eviction."""
    for i, key in enumerate(chain(count, seed=seed)):
        assert backend.set([key], ids(40 + i % 8, 41 + i % 8)) == 1


def stored_and_equal(backend: FileBackend, host: HostPool, keys: Sequence[bytes],
                     values: torch.Tensor) -> bool:
    got = backend.get(keys, ids(20, 20 + len(keys)))
    return got == len(keys) and page_bytes_of(host, ids(20, 20 + len(keys))) == as_bytes(values)


def test_pinned_pages_survive_an_eviction_storm_past_the_cap(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file()
    assert backend.supports_pins
    keys = chain(2, seed=1)
    values = fill_random(host, ids(0, 2), seed=2)
    assert backend.set(keys, ids(0, 2)) == 2
    assert backend.pin(keys, FAR) == 2
    fill_random(host, ids(40, 48), seed=3)
    storm(backend, 20, seed=4)
    assert all(on_disk(root, key) for key in keys)
    assert stored_and_equal(backend, host, keys, values)
    assert backend.total_bytes <= CAP
    assert backend.stats().failures == {"evicted": 18}  # 22 pages through a cap of 4
    backend.check_integrity()


def test_another_instance_on_the_directory_and_a_restart_honour_the_pins(
    root: Path, open_file: Opener
) -> None:
    first, host = open_file()
    keys = chain(2, seed=1)
    values = fill_random(host, ids(0, 2), seed=2)
    assert first.set(keys, ids(0, 2)) == 2
    assert first.pin(keys, FAR) == 2
    second, other_host = open_file()
    fill_random(other_host, ids(40, 48), seed=3)
    assert second.exists(keys) == 2  # adopted: now among the second's pages too
    storm(second, 12, seed=4)
    assert all(on_disk(root, key) for key in keys)
    first.close()
    # A restart under a cap smaller than the pinned pages keeps them all.
    restarted, restarted_host = open_file(max_bytes=FILE_BYTES)
    assert restarted.exists(keys) == 2
    assert stored_and_equal(restarted, restarted_host, keys, values)
    restarted.check_integrity()


def test_when_pinned_pages_fill_the_cap_new_pages_are_refused_not_pinned_ones_evicted(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file(max_bytes=2 * FILE_BYTES)
    keys = chain(2, seed=1)
    fill_random(host, ids(0, 3), seed=2)
    assert backend.set(keys, ids(0, 2)) == 2
    assert backend.pin(keys, FAR) == 2
    assert backend.set(chain(1, seed=9), ids(2, 3)) == 0
    assert backend.stats().failures == {"pinned_full": 1}
    assert backend.exists(keys) == 2 and all(on_disk(root, key) for key in keys)
    backend.check_integrity()
    # Unpinned, they are the least recently used: the next page takes the place of one.
    assert backend.unpin(keys[:1]) == 1
    assert backend.set(chain(1, seed=9), ids(2, 3)) == 1
    assert not on_disk(root, keys[0]) and on_disk(root, keys[1])
    backend.check_integrity()


def test_an_expired_pin_frees_its_pages(root: Path, open_file: Opener) -> None:
    backend, host = open_file()
    keys = chain(2, seed=1)
    fill_random(host, ids(0, 2), seed=2)
    fill_random(host, ids(40, 48), seed=3)
    assert backend.set(keys, ids(0, 2)) == 2
    until = time.time() + 0.3
    assert backend.pin(keys, until) == 2
    storm(backend, 4, seed=4)
    assert all(on_disk(root, key) for key in keys)  # held while the pin lasts
    assert wait_until(lambda: time.time() > until + 0.05)
    storm(backend, 4, seed=5)
    assert not any(on_disk(root, key) for key in keys)
    backend.check_integrity()


def test_an_unpin_from_another_instance_frees_the_pages(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "HELD_RECHECK_S", 0.0)  # look again at every write
    first, host = open_file()
    keys = chain(2, seed=1)
    fill_random(host, ids(0, 2), seed=2)
    fill_random(host, ids(40, 48), seed=3)
    assert first.set(keys, ids(0, 2)) == 2
    assert first.pin(keys, FAR) == 2
    storm(first, 4, seed=4)  # the pinned pages are now held aside
    second, _ = open_file()
    assert second.unpin(keys) == 2
    assert not list((root / PINS_DIR).glob("??/*"))
    storm(first, 4, seed=5)
    assert not any(on_disk(root, key) for key in keys)
    first.check_integrity()


def test_a_full_file_system_never_evicts_a_pinned_page(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_file(max_bytes=10**9)
    old, new = chain(1, seed=1), chain(3, seed=2)
    fill_random(host, ids(0, 3), seed=3)
    assert backend.set(old, ids(0, 1)) == 1
    assert backend.pin(old, FAR) == 1
    real_replace = os.replace
    calls: list[str] = []

    def full_once(src: Any, dst: Any) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_once)
    # The only page eviction could take is pinned: nothing is freed, the batch stops.
    assert backend.set(new, ids(0, 3)) == 1
    monkeypatch.undo()
    assert backend.stats().failures == {"no_space": 1}
    assert on_disk(root, old[0]) and backend.exists(old) == 1
    backend.check_integrity()


def test_a_pin_of_a_page_not_yet_stored_holds_it_once_written(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file()
    keys = chain(1, seed=1)
    assert backend.pin(keys, FAR) == 1
    fill_random(host, ids(0, 1), seed=2)
    fill_random(host, ids(40, 48), seed=3)
    assert backend.set(keys, ids(0, 1)) == 1
    storm(backend, 10, seed=4)
    assert on_disk(root, keys[0])


@pytest.mark.parametrize(
    "until", [math.nan, math.inf, -1.0, 0, "tomorrow", True, None],
    ids=["nan", "inf", "negative", "zero", "text", "bool", "none"],
)
def test_bad_expiries_are_refused_and_pin_nothing(
    root: Path, open_file: Opener, until: Any
) -> None:
    backend, _ = open_file()
    with pytest.raises(StorageError, match="expiry"):
        backend.pin(chain(1), until)
    assert not list((root / PINS_DIR).glob("??/*"))


def test_bad_keys_are_refused(open_file: Opener) -> None:
    backend, _ = open_file()
    with pytest.raises(StorageError, match="16 bytes"):
        backend.pin([b"short"], FAR)
    with pytest.raises(StorageError, match="16 bytes"):
        backend.unpin(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(StorageError, match="at most"):
        backend.pin(chain(129), FAR)
    backend.close()
    with pytest.raises(StorageError, match="after close"):
        backend.pin(chain(1), FAR)


def test_a_backend_without_pins_refuses_to_pin(tmp_path: Path) -> None:
    class NoPins(StorageBackend):
        name = "nopins"

        def exists(self, keys: Sequence[bytes]) -> int:
            return 0

        def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
            return 0

        def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
            return 0

        def clear(self) -> None:
            pass

    backend = NoPins()
    assert not backend.supports_pins
    with pytest.raises(StorageError, match="cannot pin"):
        backend.pin(chain(1), FAR)
    assert backend.unpin(chain(1)) == 0
    controller = StorageController(backend, CircuitBreaker())
    assert not controller.supports_pins
    with pytest.raises(StorageError, match="cannot pin"):
        controller.pin(chain(1), FAR)
    controller.unpin(chain(1))  # nothing pinned: nothing to do
    assert controller.num_outstanding == 0


def test_the_controller_pins_and_unpins_on_its_write_thread(
    root: Path, open_file: Opener
) -> None:
    backend, _ = open_file()
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        assert controller.supports_pins
        keys = chain(200, seed=1)  # more than one batch
        with pytest.raises(StorageError, match="expiry"):
            controller.pin(keys, math.nan)
        controller.pin(keys, FAR)
        assert controller.wait_idle(30)
        assert len(list((root / PINS_DIR).glob("??/*"))) == 200
        controller.unpin(keys)
        assert controller.wait_idle(30)
        assert not list((root / PINS_DIR).glob("??/*"))
        assert controller.poll() == []  # pins are fire and forget
        metrics = controller.snapshot()
        assert (metrics.pin_pages, metrics.unpin_pages, metrics.pin_pages_failed) == (
            200, 200, 0
        )
    finally:
        controller.stop()


def test_a_pin_that_raises_is_counted_not_propagated(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, _ = open_file()

    def broken(keys: Sequence[bytes], until_unix_s: float) -> int:
        raise OSError("disk gone")

    monkeypatch.setattr(backend, "pin", broken)
    controller = StorageController(backend, CircuitBreaker())
    controller.start()
    try:
        controller.pin(chain(3), FAR)
        assert controller.wait_idle(30)
        metrics = controller.snapshot()
        assert metrics.pin_pages_failed == 3 and metrics.failures == {"pin_raised": 1}
    finally:
        controller.stop()


def test_a_throttled_file_store_pins_through_to_the_file_store(root: Path) -> None:
    backend = ThrottledBackend({"backend": "file",
                                "backend_extra": {"path": str(root), "max_bytes": CAP}})
    host = HostPool(GEOMETRY, 64, PAGE_SIZE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend.attach(host)
    try:
        assert backend.supports_pins
        keys = chain(2, seed=1)
        fill_random(host, ids(0, 2), seed=2)
        assert backend.set(keys, ids(0, 2)) == 2
        assert backend.pin(keys, FAR) == 2
        assert len(list((root / PINS_DIR).glob("??/*"))) == 2
        assert backend.unpin(keys) == 2
        assert not list((root / PINS_DIR).glob("??/*"))
    finally:
        backend.close()


def test_a_file_store_loaded_as_a_dynamic_backend_pins_through_it(root: Path) -> None:
    backend = DynamicBackend({"module_path": "hicache.storage.backends.file.backend",
                              "class_name": "FileBackend", "path": str(root)})
    host = HostPool(GEOMETRY, 64, PAGE_SIZE, MemLayout.PAGE_FIRST, pin_memory=False)
    backend.attach(host)
    try:
        assert backend.supports_pins
        keys = chain(2, seed=1)
        assert backend.pin(keys, FAR) == 2
        assert len(list((root / PINS_DIR).glob("??/*"))) == 2
        with pytest.raises(StorageError, match="16 bytes"):
            backend.pin([b"short"], FAR)
        assert backend.unpin(keys) == 2
        assert not list((root / PINS_DIR).glob("??/*"))
    finally:
        backend.close()


def test_markers_long_expired_and_dead_writers_temporaries_are_swept_at_attach(
    root: Path, open_file: Opener
) -> None:
    first, _ = open_file()
    live, stale, recent = chain(3, seed=1)
    assert first.pin([live], FAR) == 1
    assert first.pin([stale], time.time() + 1) == 1
    assert first.pin([recent], time.time() + 1) == 1
    markers = {key: root / PINS_DIR / name[:2] / name for key in (live, stale, recent)
               for name in [object_name(key, PayloadOrder.TOKEN_MAJOR)]}
    long_ago = time.time() - 3600
    os.utime(markers[stale], (long_ago, long_ago))
    just_now = time.time() - 1
    os.utime(markers[recent], (just_now, just_now))  # expired, but within the grace
    leftover = markers[live].parent / f".{markers[live].name}.1.2.tmp"
    leftover.touch()
    os.utime(leftover, (long_ago, long_ago))
    open_file()
    assert markers[live].exists() and markers[recent].exists()
    assert not markers[stale].exists() and not leftover.exists()
