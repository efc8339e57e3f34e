"""The file store's direct writes: a plain page's payload goes to the disk with O_DIRECT
and its header through the page cache, making the same file a buffered write makes; pools
whose regions are not block aligned, sealed pages and ``direct_writes: false`` write
through the page cache; a file system that refuses direct writes costs a warning and
nothing else; a real I/O error fails the page as before. "auto" (the default) writes directly
where the model's forward runs on the CPU, as the cache tells the store.

Every test writes real files in a temporary directory. The ones that need the real
O_DIRECT path skip where the test directory's file system has none (some tmpfs, FUSE).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file import direct_writes, vectored
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageError
from hicache.storage.failure_reasons import FailureReason
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from hicache.storage.seal_workers import SealWorkers
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from tests.l3_caches import make_l3_cache
from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range

# float32, 4 tokens a page: a page_first page is 8 KiB, a layer_first region 2 KiB, both
# whole 512-byte blocks. The other geometry's layer_first regions are 128 bytes.
ALIGNED = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)
UNALIGNED = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
# 256 KiB pages: as large as "auto" writes directly (ALIGNED's 8 KiB ones it does not).
LARGE = KVGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.float32)
PAGE = 4
PAGES = 6
O_DIRECT = direct_writes.O_DIRECT


def has_direct_io(directory: Path) -> bool:
    """Does ``directory``'s file system take an aligned O_DIRECT write?"""
    if not O_DIRECT:
        return False
    block = mmap.mmap(-1, 4096)  # page aligned
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, block)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(directory / "probe")
        block.close()


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not has_direct_io(tmp_path):
        pytest.skip("the test directory's file system has no O_DIRECT")
    return tmp_path


def keys_for(geometry: KVGeometry, count: int, seed: int = 0) -> list[bytes]:
    namespace = KeyNamespace("direct-tests", geometry.describe(), PAGE)
    tokens = np.random.default_rng(seed).integers(0, 32000, count * PAGE)
    return chain_page_keys(pack_tokens(tokens), PAGE, namespace.seed())


def open_store(
    root: Path, geometry: KVGeometry = ALIGNED, layout: MemLayout = MemLayout.LAYER_FIRST,
    **options: Any,
) -> tuple[FileBackend, HostPool]:
    """A store on ``root`` writing directly unless ``options`` say otherwise."""
    host = HostPool(geometry, 2 * PAGES, PAGE, layout, pin_memory=False)
    backend = FileBackend({"path": str(root), "direct_writes": True, **options})
    backend.attach(host)
    return backend, host


def page_file(root: Path, key: bytes, layout: MemLayout) -> Path:
    name = object_name(key, PayloadOrder.of_layout(layout))
    return root / name[:2] / name


class WriteSpy:
    """Records, for every ``writev`` of a page file, its bytes and whether its descriptor
    had O_DIRECT; ``fail`` makes the calls under O_DIRECT raise that errno instead."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: int | None = None) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.fail = fail
        real = os.writev

        def writev(fd: int, buffers: Sequence[Any]) -> int:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
            if direct and self.fail is not None:
                raise OSError(self.fail, os.strerror(self.fail))
            wrote = real(fd, buffers)
            self.calls.append((wrote, direct))
            return wrote

        monkeypatch.setattr(vectored.os, "writev", writev)

    @property
    def direct_bytes(self) -> int:
        return sum(wrote for wrote, direct in self.calls if direct)

    @property
    def buffered_bytes(self) -> int:
        return sum(wrote for wrote, direct in self.calls if not direct)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriteSpy]:
    yield WriteSpy(monkeypatch)


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_payloads_go_direct_and_the_files_are_those_a_buffered_write_makes(
    direct_dir: Path, spy: WriteSpy, layout: MemLayout
) -> None:
    keys = keys_for(ALIGNED, PAGES)
    direct, host = open_store(direct_dir / "direct", layout=layout)
    assert direct.direct is not None
    values = fill_random(host, page_range(0, PAGES), seed=3)
    assert direct.set(keys, page_range(0, PAGES)) == PAGES
    # Every payload byte went with O_DIRECT, every header through the page cache.
    assert spy.direct_bytes == PAGES * host.page_bytes
    assert spy.buffered_bytes == PAGES * HEADER_BYTES
    assert direct.direct.num_direct_pages == PAGES

    buffered, other = open_store(direct_dir / "buffered", layout=layout, direct_writes=False)
    assert buffered.direct is None
    other.flat.copy_(host.flat)
    assert buffered.set(keys, page_range(0, PAGES)) == PAGES
    for key in keys:
        assert page_file(direct_dir / "direct", key, layout).read_bytes() == page_file(
            direct_dir / "buffered", key, layout
        ).read_bytes()

    # A fresh store on the directory reads the pages back, checksums checked.
    reader, target = open_store(direct_dir / "direct", layout=layout)
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(target, page_range(PAGES, 2 * PAGES)) == as_bytes(values)
    assert reader.stats().failures == {} and direct.stats().failures == {}
    for backend in (direct, buffered, reader):
        backend.close()


def test_regions_that_are_not_block_aligned_go_through_the_page_cache(
    tmp_path: Path, spy: WriteSpy
) -> None:
    backend, host = open_store(tmp_path, UNALIGNED, MemLayout.LAYER_FIRST)
    assert backend.direct is None
    assert direct_writes.usable(backend._ready([])) is not None
    values = fill_random(host, page_range(0, PAGES), seed=4)
    keys = keys_for(UNALIGNED, PAGES)
    assert backend.set(keys, page_range(0, PAGES)) == PAGES
    assert spy.direct_bytes == 0 and spy.buffered_bytes == PAGES * (host.page_bytes + HEADER_BYTES)
    assert backend.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == as_bytes(values)
    backend.close()


def test_direct_writes_off_goes_through_the_page_cache(tmp_path: Path, spy: WriteSpy) -> None:
    backend, host = open_store(tmp_path, direct_writes="false")
    assert backend.direct is None
    fill_random(host, page_range(0, PAGES), seed=5)
    assert backend.set(keys_for(ALIGNED, PAGES), page_range(0, PAGES)) == PAGES
    assert spy.direct_bytes == 0
    backend.close()


@pytest.mark.parametrize(("setting", "forward_on_cpu", "geometry", "direct"), [
    ("auto", True, LARGE, True), ("auto", False, LARGE, False), (None, True, LARGE, True),
    (None, False, LARGE, False), ("auto", True, ALIGNED, False), (None, True, ALIGNED, False),
    ("true", False, ALIGNED, True), ("false", True, LARGE, False),
])
def test_auto_writes_large_pages_directly_where_the_forward_runs_on_the_cpu(
    tmp_path: Path, setting: str | None, forward_on_cpu: bool, geometry: KVGeometry,
    direct: bool,
) -> None:
    options = {} if setting is None else {"direct_writes": setting}
    backend = FileBackend({"path": str(tmp_path), **options})
    backend.forward_runs_on_cpu(forward_on_cpu)
    host = HostPool(geometry, PAGES, PAGE, MemLayout.LAYER_FIRST, pin_memory=False)
    assert (host.page_bytes >= direct_writes.AUTO_MIN_PAGE_BYTES) is (geometry is LARGE)
    backend.attach(host)
    assert (backend.direct is not None) is direct
    backend.close()


def test_a_cache_on_the_cpu_writes_its_l3_pages_directly(tmp_path: Path) -> None:
    """The cache tells the store where the forward runs: a CPU device pool's cache gets
    direct writes of its large pages at the file store's defaults, through a throttled
    store too."""
    for name, extra in (
        ("file", {"path": str(tmp_path / "a")}),
        ("throttled", {"backend": "file", "backend_extra": {"path": str(tmp_path / "b")}}),
    ):
        cache = make_l3_cache(name, extra, LARGE, page_size=PAGE, device_pages=8)
        try:
            assert cache.device_pool.device.type == "cpu"
            assert cache.storage is not None
            backend = cache.storage.backend
            inner = getattr(backend, "inner", backend)
            assert isinstance(inner, FileBackend) and inner.direct is not None, name
        finally:
            cache.close()


def test_the_setting_is_true_false_or_auto(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="direct_writes must be true, false or auto"):
        FileBackend({"path": str(tmp_path), "direct_writes": "sometimes"})


def test_sealed_pages_are_not_written_directly(tmp_path: Path, spy: WriteSpy) -> None:
    host = HostPool(ALIGNED, 2 * PAGES, PAGE, MemLayout.LAYER_FIRST, pin_memory=False)
    backend = FileBackend({"path": str(tmp_path), "direct_writes": True})
    backend.use_sealer(Sealer(parse_key_file(f"acme 1 {'a1' * 32}\n", "t.keys"), SealWorkers(1)))
    backend.attach(host)
    assert backend.direct is None
    backend.close()


@pytest.mark.parametrize(("refused_at", "answer"), [
    ("fcntl", errno.EINVAL), ("writev", errno.EINVAL), ("writev", errno.EOPNOTSUPP),
])
def test_a_file_system_that_refuses_direct_writes_costs_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    refused_at: str, answer: int,
) -> None:
    """Some file systems refuse O_DIRECT when it is set; a device whose blocks are larger
    than the regions refuses the write itself. Either way the page is written through the
    page cache, whole, and so is every later one; one warning says so."""
    spy = WriteSpy(monkeypatch, fail=answer if refused_at == "writev" else None)
    if refused_at == "fcntl":
        real_fcntl = fcntl.fcntl

        def refusing(fd: int, command: int, arg: int = 0) -> int:
            if command == fcntl.F_SETFL and arg & O_DIRECT:
                raise OSError(answer, os.strerror(answer))
            return real_fcntl(fd, command, arg)

        monkeypatch.setattr(direct_writes.fcntl, "fcntl", refusing)
    backend, host = open_store(tmp_path)
    writer = backend.direct
    assert writer is not None and writer.active
    values = fill_random(host, page_range(0, PAGES), seed=6)
    keys = keys_for(ALIGNED, PAGES)
    with caplog.at_level(logging.WARNING, logger=direct_writes.__name__):
        assert backend.set(keys[:3], page_range(0, 3)) == 3
        assert backend.set(keys[3:], page_range(3, PAGES)) == PAGES - 3
    assert not writer.active and writer.num_direct_pages == 0
    refusals = [r for r in caplog.records if "refuses direct writes" in r.getMessage()]
    assert len(refusals) == 1
    assert spy.direct_bytes == 0
    assert backend.stats().failures == {}
    assert all(
        page_file(tmp_path, key, MemLayout.LAYER_FIRST).stat().st_size
        == host.page_bytes + HEADER_BYTES
        for key in keys
    )
    reader, target = open_store(tmp_path)
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(target, page_range(PAGES, 2 * PAGES)) == as_bytes(values)
    backend.close()
    reader.close()


def test_a_full_disk_under_a_direct_write_fails_the_page_as_before(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC is the disk's answer, not a refusal of direct I/O: the page is a counted
    failure (after the store's one eviction round), no temporary is left, and direct
    writes stay on."""
    backend, host = open_store(direct_dir)
    fill_random(host, page_range(0, PAGES), seed=7)
    WriteSpy(monkeypatch, fail=errno.ENOSPC)
    assert backend.set(keys_for(ALIGNED, 2), page_range(0, 2)) == 0
    assert backend.stats().failures == {FailureReason.NO_SPACE.value: 1}
    assert backend.direct is not None and backend.direct.active
    assert list(direct_dir.glob("??/.*")) == [] and len(backend) == 0
    backend.close()
