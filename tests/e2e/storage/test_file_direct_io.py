"""The file store's direct I/O: a plain page's payload goes to the disk with O_DIRECT
and its header through the page cache, making the same file a buffered write makes; pools
whose regions are not block aligned, sealed pages and ``direct_writes: false`` write
through the page cache; a file system that refuses direct writes costs a warning and
nothing else; a real I/O error fails the page as before. "auto" (the default) writes directly
where the model's forward runs on the CPU, as the cache tells the store. Reads follow the
writes at "auto": the payload is read directly, the header through the page cache, the page
checked as before; a refused direct read is read again through the page cache; a file of
another length is read the old way and refused; and a cache on the CPU gets cold-equal KV
back from pages it read directly.

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

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file import direct_io, vectored
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageError
from hicache.storage.failure_reasons import FailureReason
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from hicache.storage.seal_workers import SealWorkers
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from tests.l3_caches import assert_a_new_cache_reuses, l3_backend_of, make_l3_cache
from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range

# float32, 4 tokens a page: a page_first page is 8 KiB, a layer_first region 2 KiB, both
# whole 512-byte blocks. The other geometry's layer_first regions are 128 bytes.
ALIGNED = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)
UNALIGNED = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
# 256 KiB pages: as large as "auto" writes directly (ALIGNED's 8 KiB ones it does not).
LARGE = KVGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.float32)
PAGE = 4
PAGES = 6
O_DIRECT = direct_io.O_DIRECT


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


class VectoredSpy:
    """Records, for every ``call`` (``readv`` or ``writev``) of a page file, its bytes and
    whether its descriptor had O_DIRECT; ``fail`` makes the calls under O_DIRECT raise that
    errno instead."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, call: str = "writev", fail: int | None = None
    ) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.fail = fail
        real = getattr(os, call)

        def spied(fd: int, buffers: Sequence[Any]) -> int:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
            if direct and self.fail is not None:
                raise OSError(self.fail, os.strerror(self.fail))
            moved: int = real(fd, buffers)
            self.calls.append((moved, direct))
            return moved

        monkeypatch.setattr(vectored.os, call, spied)

    @property
    def direct_bytes(self) -> int:
        return sum(moved for moved, direct in self.calls if direct)

    @property
    def buffered_bytes(self) -> int:
        return sum(moved for moved, direct in self.calls if not direct)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[VectoredSpy]:
    yield VectoredSpy(monkeypatch)


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_payloads_go_direct_and_the_files_are_those_a_buffered_write_makes(
    direct_dir: Path, spy: VectoredSpy, layout: MemLayout
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
    tmp_path: Path, spy: VectoredSpy
) -> None:
    backend, host = open_store(tmp_path, UNALIGNED, MemLayout.LAYER_FIRST)
    assert backend.direct is None
    assert direct_io.usable(backend._ready([])) is not None
    values = fill_random(host, page_range(0, PAGES), seed=4)
    keys = keys_for(UNALIGNED, PAGES)
    assert backend.set(keys, page_range(0, PAGES)) == PAGES
    assert spy.direct_bytes == 0 and spy.buffered_bytes == PAGES * (host.page_bytes + HEADER_BYTES)
    assert backend.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == as_bytes(values)
    backend.close()


def test_direct_writes_off_goes_through_the_page_cache(tmp_path: Path, spy: VectoredSpy) -> None:
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
    assert (host.page_bytes >= direct_io.AUTO_MIN_PAGE_BYTES) is (geometry is LARGE)
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


def test_sealed_pages_are_not_written_directly(tmp_path: Path, spy: VectoredSpy) -> None:
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
    spy = VectoredSpy(monkeypatch, fail=answer if refused_at == "writev" else None)
    if refused_at == "fcntl":
        real_fcntl = fcntl.fcntl

        def refusing(fd: int, command: int, arg: int = 0) -> int:
            if command == fcntl.F_SETFL and arg & O_DIRECT:
                raise OSError(answer, os.strerror(answer))
            return real_fcntl(fd, command, arg)

        monkeypatch.setattr(direct_io.fcntl, "fcntl", refusing)
    backend, host = open_store(tmp_path)
    writer = backend.direct
    assert writer is not None and writer.active
    values = fill_random(host, page_range(0, PAGES), seed=6)
    keys = keys_for(ALIGNED, PAGES)
    with caplog.at_level(logging.WARNING, logger=direct_io.__name__):
        assert backend.set(keys[:3], page_range(0, 3)) == 3
        assert backend.set(keys[3:], page_range(3, PAGES)) == PAGES - 3
    assert not writer.active and writer.num_direct_pages == 0
    refusals = [r for r in caplog.records if "refuses direct I/O" in r.getMessage()]
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
    VectoredSpy(monkeypatch, fail=errno.ENOSPC)
    assert backend.set(keys_for(ALIGNED, 2), page_range(0, 2)) == 0
    assert backend.stats().failures == {FailureReason.NO_SPACE.value: 1}
    assert backend.direct is not None and backend.direct.active
    assert list(direct_dir.glob("??/.*")) == [] and len(backend) == 0
    backend.close()


# ---------------------------------------------------------------------- reads
def stored_pages(root: Path, layout: MemLayout = MemLayout.LAYER_FIRST, **options: Any) -> tuple[
    list[bytes], bytes
]:
    """Keys of PAGES pages a store on ``root`` wrote, and their payload bytes."""
    writer, host = open_store(root, layout=layout, **options)
    values = fill_random(host, page_range(0, PAGES), seed=8)
    keys = keys_for(ALIGNED, PAGES)
    assert writer.set(keys, page_range(0, PAGES)) == PAGES
    writer.close()
    return keys, as_bytes(values)


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_payloads_are_read_directly_and_headers_through_the_page_cache(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, layout: MemLayout
) -> None:
    keys, values = stored_pages(direct_dir, layout)
    spy = VectoredSpy(monkeypatch, "readv")
    reader, host = open_store(direct_dir, layout=layout)
    assert reader.direct is not None and reader.direct.reads
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == values
    assert spy.direct_bytes == PAGES * host.page_bytes
    assert spy.buffered_bytes == PAGES * HEADER_BYTES
    assert reader.direct.num_direct_reads == PAGES
    assert reader.stats().failures == {}
    reader.close()


def test_direct_reads_off_read_through_the_page_cache(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, values = stored_pages(direct_dir)
    spy = VectoredSpy(monkeypatch, "readv")
    reader, host = open_store(direct_dir, direct_reads="false")
    assert reader.direct is not None and reader.direct.writes and not reader.direct.reads
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == values
    assert spy.direct_bytes == 0 and reader.direct.num_direct_reads == 0
    reader.close()


def test_direct_reads_alone_leave_the_writes_buffered(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = VectoredSpy(monkeypatch)
    reads = VectoredSpy(monkeypatch, "readv")
    keys, values = stored_pages(direct_dir, direct_writes="false", direct_reads="true")
    assert writes.direct_bytes == 0
    reader, host = open_store(direct_dir, direct_writes="false", direct_reads="true")
    assert reader.direct is not None and not reader.direct.writes
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == PAGES
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == values
    assert reads.direct_bytes == PAGES * host.page_bytes
    reader.close()


@pytest.mark.parametrize("answer", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_refused_direct_read_reads_the_page_through_the_page_cache(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    answer: int,
) -> None:
    """A device that refuses the direct read costs one warning: that page and every later
    one are read whole through the page cache, and later writes go through it too."""
    keys, values = stored_pages(direct_dir)
    spy = VectoredSpy(monkeypatch, "readv", fail=answer)
    reader, host = open_store(direct_dir)
    direct = reader.direct
    assert direct is not None and direct.active
    with caplog.at_level(logging.WARNING, logger=direct_io.__name__):
        assert reader.get(keys[:2], page_range(PAGES, PAGES + 2)) == 2
        assert reader.get(keys[2:], page_range(PAGES + 2, 2 * PAGES)) == PAGES - 2
    assert page_bytes_of(host, page_range(PAGES, 2 * PAGES)) == values
    assert not direct.active and direct.num_direct_reads == 0
    assert len([r for r in caplog.records if "refuses direct I/O" in r.getMessage()]) == 1
    assert spy.direct_bytes == 0
    assert spy.buffered_bytes == PAGES * (host.page_bytes + HEADER_BYTES)
    assert reader.stats().failures == {}
    writes = VectoredSpy(monkeypatch)
    fill_random(host, page_range(0, 1), seed=9)
    assert reader.set(keys_for(ALIGNED, 1, seed=1), page_range(0, 1)) == 1
    assert writes.direct_bytes == 0
    reader.close()


def test_a_real_read_error_under_a_direct_read_fails_the_page(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO is the disk's answer, not a refusal: the page is a counted failure (a miss),
    and direct reads stay on."""
    keys, _ = stored_pages(direct_dir)
    VectoredSpy(monkeypatch, "readv", fail=errno.EIO)
    reader, _host = open_store(direct_dir)
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == 0
    assert reader.stats().failures == {FailureReason.IO_ERROR.value: 1}
    assert reader.direct is not None and reader.direct.active
    reader.close()


def test_a_corrupt_page_read_directly_is_caught_and_dropped(direct_dir: Path) -> None:
    """A payload byte changed on the disk: the direct read lands it, the checksum finds it,
    the page is dropped (a miss), the pages before it are read."""
    keys, values = stored_pages(direct_dir)
    path = page_file(direct_dir, keys[3], MemLayout.LAYER_FIRST)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    reader, host = open_store(direct_dir)
    assert reader.get(keys, page_range(PAGES, 2 * PAGES)) == 3
    assert page_bytes_of(host, page_range(PAGES, PAGES + 3)) == values[: 3 * host.page_bytes]
    assert not path.exists()
    assert reader.direct is not None and reader.direct.num_direct_reads >= 3
    reader.close()


def test_a_page_file_of_another_length_is_read_buffered_and_refused(direct_dir: Path) -> None:
    """A file shorter or longer than a page's is not read directly (its end is not where
    a direct read expects it): it is read as before and found wrong."""
    keys, _ = stored_pages(direct_dir)
    for index, change in ((0, b"trailing"), (1, None)):
        path = page_file(direct_dir, keys[index], MemLayout.LAYER_FIRST)
        data = path.read_bytes()
        path.write_bytes(data + change if change is not None else data[:-10])
        reader, _host = open_store(direct_dir)
        assert reader.get(keys[index:], page_range(PAGES, 2 * PAGES - index)) == 0
        assert reader.direct is not None and reader.direct.num_direct_reads == 0
        assert not path.exists()
        reader.close()


def test_the_read_setting_is_true_false_or_auto(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="direct_reads must be true, false or auto"):
        FileBackend({"path": str(tmp_path), "direct_reads": "often"})


def test_a_cache_on_the_cpu_reads_its_l3_pages_directly_and_they_equal_cold_kv(
    direct_dir: Path,
) -> None:
    """At the file store's defaults, a CPU device pool's cache writes and reads its large
    pages directly; a new cache on the store gets every token from L3, the KV oracle
    checking each hit against cold KV."""
    stores: list[FileBackend] = []

    def make_cache() -> HierarchicalCache:
        cache = make_l3_cache("file", {"path": str(direct_dir)}, LARGE, page_size=PAGE,
                              device_pages=16)
        stores.append(l3_backend_of(cache, FileBackend))
        return cache

    assert_a_new_cache_reuses(make_cache, list(range(1000, 1000 + 6 * PAGE)))
    reads = [store.direct for store in stores]
    assert all(direct is not None and direct.reads for direct in reads)
    # The second cache read the 6 pages twice (before and after forgetting L1 and L2).
    assert [direct.num_direct_reads for direct in reads if direct is not None] == [0, 12]
