"""The file store's sealed paths: pages sealed piece by piece as they are written, a few
side by side on the sealer's threads, and opened on those threads straight from the mapped
file (or read and opened in place where a file cannot be mapped). Every path writes frames
every other path opens to the same bytes, and any damage is still a miss, counted."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file import backend as file_backend
from hicache.storage.backends.file import mapped as mapped_module
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.call_tenant import call_tenant
from hicache.storage.frame import SEALED_HEADER_BYTES
from hicache.storage.seal_workers import SealWorkers
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import parse_key_file
from tests.integration.storage.test_clear_store import GEOMETRY, PAGE
from tests.integration.storage.test_file_tenants import keys_of
from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range

KEYS = f"acme 1 {'a1' * 32}\nacme 2 {'a2' * 32}\n"
BATCH = 6


def open_store(root: Path, workers: int, layout: MemLayout = MemLayout.LAYER_FIRST,
               keys: str = KEYS) -> tuple[FileBackend, HostPool]:
    host = HostPool(GEOMETRY, 2 * BATCH, PAGE, layout, pin_memory=False)
    backend = FileBackend({"path": str(root)})
    backend.use_sealer(Sealer(parse_key_file(keys, "test.keys"), SealWorkers(workers)))
    backend.attach(host)
    return backend, host


@contextlib.contextmanager
def unmappable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Page files cannot be mapped (an old kernel): they are read, then opened in place."""

    @contextlib.contextmanager
    def no_mapping(fd: int, size: int) -> Iterator[None]:
        yield None

    with monkeypatch.context() as patch:
        patch.setattr(file_backend, "mapped", no_mapping)
        yield


def page_files(root: Path) -> list[Path]:
    return sorted(root.glob("tenants/*/??/*.?m"))


def read_back(backend: FileBackend, keys: list[bytes]) -> int:
    with call_tenant("acme"):
        return backend.get(keys, page_range(BATCH, BATCH + len(keys)))


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
@pytest.mark.parametrize(("writer_workers", "reader_workers", "mapped"), [
    (2, 1, True), (1, 2, True), (2, 2, False), (1, 1, False),
])
def test_every_path_opens_what_every_path_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: MemLayout, writer_workers: int,
    reader_workers: int, mapped: bool,
) -> None:
    writer, host = open_store(tmp_path, writer_workers, layout)
    values = fill_random(host, page_range(0, BATCH), seed=5)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert writer.set(keys, page_range(0, BATCH)) == BATCH
    files = page_files(tmp_path)
    assert len(files) == BATCH
    assert all(f.stat().st_size == SEALED_HEADER_BYTES + host.page_bytes for f in files)
    assert not any(as_bytes(values[0])[:64] in f.read_bytes() for f in files)  # no plaintext
    reader, other_host = open_store(tmp_path, reader_workers, layout)
    with contextlib.ExitStack() as stack:
        if not mapped:
            stack.enter_context(unmappable(monkeypatch))
        assert read_back(reader, keys) == BATCH
    assert page_bytes_of(other_host, page_range(BATCH, 2 * BATCH)) == as_bytes(values)
    assert reader.stats().failures == {}
    writer.close()
    reader.close()


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST])
def test_pages_sealed_in_odd_pieces_open_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: MemLayout
) -> None:
    """Pieces smaller than a region and not a multiple of the cipher's block: the file
    holds the page's ciphertext whole, in order, and opens to the page."""
    monkeypatch.setattr(file_backend, "SEAL_WRITE_PIECE", 24)
    writer, host = open_store(tmp_path, 2, layout)
    assert min(view.nbytes for view in writer._regions.views(0)) > 24  # type: ignore[union-attr]
    values = fill_random(host, page_range(0, BATCH), seed=8)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert writer.set(keys, page_range(0, BATCH)) == BATCH
    assert all(f.stat().st_size == SEALED_HEADER_BYTES + host.page_bytes
               for f in page_files(tmp_path))
    reader, other_host = open_store(tmp_path, 1, layout)
    assert read_back(reader, keys) == BATCH
    assert page_bytes_of(other_host, page_range(BATCH, 2 * BATCH)) == as_bytes(values)
    assert reader.stats().failures == {}
    writer.close()
    reader.close()


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("damage", ["payload", "tag", "key_id", "truncated"])
def test_a_damaged_page_mid_batch_is_a_counted_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, mapped: bool
) -> None:
    """Page 2 of a batch damaged: the read answers the two pages before it, counts the
    damage under its reason and drops the file; the pages read are the ones written."""
    backend, host = open_store(tmp_path, 2)
    values = fill_random(host, page_range(0, BATCH), seed=9)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys, page_range(0, BATCH)) == BATCH
    victim = next(f for f in page_files(tmp_path) if f.name.startswith(keys[2].hex()))
    data = bytearray(victim.read_bytes())
    page_bytes = host.page_bytes
    if damage == "payload":
        data[page_bytes // 2] ^= 1
    elif damage == "tag":
        data[page_bytes + 40] ^= 1  # the tag sits where a plain frame keeps its checksum
    elif damage == "key_id":
        data[page_bytes + 60 : page_bytes + 64] = (7).to_bytes(4, "little")
    else:
        del data[page_bytes // 2 :]
    victim.write_bytes(bytes(data))
    expected = {
        "payload": "bad_tag", "tag": "bad_tag", "key_id": "unknown_key",
        "truncated": "short_read",
    }[damage]
    with contextlib.ExitStack() as stack:
        if not mapped:
            stack.enter_context(unmappable(monkeypatch))
        assert read_back(backend, keys) == 2
    assert page_bytes_of(host, page_range(BATCH, BATCH + 2)) == as_bytes(values[:2])
    assert backend.stats().failures.get(expected) == 1
    assert not victim.exists()
    backend.check_integrity()
    backend.close()


def test_an_io_error_mapping_a_page_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_store(tmp_path, 2)
    fill_random(host, page_range(0, BATCH), seed=2)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys, page_range(0, BATCH)) == BATCH

    @contextlib.contextmanager
    def failing(fd: int, size: int) -> Iterator[None]:
        raise OSError(5, "Input/output error")
        yield None

    monkeypatch.setattr(file_backend, "mapped", failing)
    assert read_back(backend, keys) == 0
    assert backend.stats().failures.get("io_error", 0) >= 1
    backend.close()


def test_pages_sealed_side_by_side_each_get_a_fresh_nonce(tmp_path: Path) -> None:
    """Pages sealed side by side, each by its own thread: each file is its own page's
    (the same host page under two keys has two different ciphertexts and nonces)."""
    backend, host = open_store(tmp_path, 3)
    values = fill_random(host, page_range(0, 1), seed=4)
    for page in range(1, BATCH):
        host.pages[page] = host.pages[0]
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys, np.zeros(BATCH, dtype=np.int64)) == BATCH
    files = page_files(tmp_path)
    nonces = {f.read_bytes()[-16:-4] for f in files}
    bodies = {f.read_bytes()[: host.page_bytes] for f in files}
    assert len(nonces) == len(bodies) == BATCH
    assert read_back(backend, keys) == BATCH
    assert page_bytes_of(host, page_range(BATCH, 2 * BATCH)) == as_bytes(values) * BATCH
    backend.close()


def test_a_file_system_that_cannot_map_files_is_read_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_store(tmp_path, 2)
    values = fill_random(host, page_range(0, BATCH), seed=6)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys, page_range(0, BATCH)) == BATCH

    def no_mmap(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mapped_module.mmap, "mmap", no_mmap)
    assert read_back(backend, keys) == BATCH
    assert page_bytes_of(host, page_range(BATCH, 2 * BATCH)) == as_bytes(values)
    assert backend.stats().failures == {}
    backend.close()


def test_pages_missing_past_the_first_are_not_counted_again(tmp_path: Path) -> None:
    """A batch whose tail L3 does not hold (the usual prefix hit): one "missing", however
    many pages the sealer's threads looked for beside it."""
    backend, host = open_store(tmp_path, 3)
    fill_random(host, page_range(0, 2), seed=1)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys[:2], page_range(0, 2)) == 2
    assert read_back(backend, keys) == 2
    assert backend.stats().failures == {"missing": 1}
    backend.close()


def test_pages_already_stored_are_not_sealed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_store(tmp_path, 2)
    values = fill_random(host, page_range(0, BATCH), seed=3)
    keys = keys_of("acme", BATCH)
    with call_tenant("acme"):
        assert backend.set(keys[1:3], page_range(1, 3)) == 2
    sealed_pages: list[bytes] = []
    begin = Sealer.begin

    def counting(self: Sealer, key: bytes, *args: object) -> object:
        sealed_pages.append(key)
        return begin(self, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Sealer, "begin", counting)
    with call_tenant("acme"):
        assert backend.set(keys, page_range(0, BATCH)) == BATCH
    assert sorted(sealed_pages) == sorted([keys[0], *keys[3:]])
    assert backend.stats().pages_skipped_existing == 2
    assert read_back(backend, keys) == BATCH
    assert page_bytes_of(host, page_range(BATCH, 2 * BATCH)) == as_bytes(values)
    backend.close()
