"""The file backend beyond the shared contract: options, atomic writes, crash leftovers,
the size cap and its LRU order, restarts, shared directories, and integrity checks.

Every test works on real files in a temporary directory.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.file.ledger import LEDGER_FILE
from hicache.storage.backends.file.settings import default_min_free
from hicache.storage.base import StorageError, StorageUnavailableError
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from hicache.storage.page_files import STALE_TEMP_AGE_S, temp_name
from tests.file_opener import FileOpener
from tests.full_disk import run_on_tmpfs, tmpfs_unavailable_reason
from tests.storage_contract import as_bytes, fill_random, page_bytes_of

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4
PAGE_BYTES = GEOMETRY.page_bytes(PAGE_SIZE)
FILE_BYTES = HEADER_BYTES + PAGE_BYTES
HEADER_AT = PAGE_BYTES  # a page file is payload || header
NAMESPACE = KeyNamespace("file-tests", GEOMETRY.describe(), PAGE_SIZE)


def make_host(layout: MemLayout = MemLayout.PAGE_FIRST, num_pages: int = 32) -> HostPool:
    return HostPool(GEOMETRY, num_pages, PAGE_SIZE, layout, pin_memory=False)


def chain(count: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 32000, count * PAGE_SIZE)
    return chain_page_keys(pack_tokens(tokens), PAGE_SIZE, NAMESPACE.seed())


def ids(start: int, stop: int) -> PageIds:
    return np.arange(start, stop, dtype=np.int64)


# Least-recently-used order unless a test says otherwise: the cap's tests here check that
# order; the core set has its own (tests/integration/storage/test_file_core_set.py).
Opener = FileOpener


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def open_file(root: Path) -> Iterator[Opener]:
    opener = FileOpener(root, make_host, core_fraction=0)
    yield opener
    opener.close()


def page_path(root: Path, key: bytes, order: PayloadOrder = PayloadOrder.TOKEN_MAJOR) -> Path:
    name = object_name(key, order)
    return root / name[:2] / name


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if not p.name.startswith("."))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/.*"))


# ----------------------------------------------------------------- options
def test_the_directory_comes_from_the_config_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert FileBackend({"path": str(tmp_path / "x")}).root == tmp_path / "x"
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    assert FileBackend({}).root == tmp_path / "cache" / "l3"
    backend = FileBackend({"max_bytes": "2GiB", "fsync": "true", "verify_checksum": False})
    assert (backend.max_bytes, backend.fsync, backend.verify_checksum) == (2 * 2**30, True, False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_bytes": "lots"}, "max_bytes must be a size"),
        ({"max_bytes": -1}, "max_bytes must be >= 0"),
        ({"fsync": "sometimes"}, "fsync must be true or false"),
        ({"path": 3}, "path must be a string"),
        ({"dir": "/tmp"}, "unknown extra-config key"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        FileBackend(options)


def test_an_unusable_directory_is_reported_at_attach(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    backend = FileBackend({"path": str(blocker / "l3")})
    with pytest.raises(StorageUnavailableError, match="cannot use directory"):
        backend.attach(make_host())


def test_pages_are_files_of_the_payload_then_its_header(root: Path, open_file: Opener) -> None:
    backend, host = open_file()
    keys = chain(2)
    fill_random(host, ids(0, 2), seed=1)
    assert backend.set(keys, ids(0, 2)) == 2
    assert page_files(root) == sorted(page_path(root, key) for key in keys)
    data = page_path(root, keys[1]).read_bytes()
    assert len(data) == FILE_BYTES
    assert data[HEADER_AT : HEADER_AT + 4] == b"HCKV"
    assert data[HEADER_AT + 16 : HEADER_AT + 32] == keys[1]
    # page_first pools hold a page contiguously: the payload is those bytes as they are.
    assert data[:HEADER_AT] == host.page_span(1).view(torch.uint8).numpy().tobytes()
    assert backend.total_bytes == 2 * FILE_BYTES and len(backend) == 2
    assert temp_files(root) == []


# ----------------------------------------------------------- atomic writes
def test_a_write_that_dies_before_the_rename_leaves_no_page(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_file()
    keys = chain(3)
    fill_random(host, ids(0, 3), seed=2)
    assert backend.set(keys[:1], ids(0, 1)) == 1

    def fail_replace(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "replace", fail_replace)
    assert backend.set(keys, ids(0, 3)) == 1  # page 0 was there; page 1 failed
    monkeypatch.undo()
    assert backend.stats().failures == {"io_error": 1}
    assert page_files(root) == [page_path(root, keys[0])]
    assert temp_files(root) == []  # the failed writer removed its temporary
    assert backend.exists(keys) == 1
    assert backend.set(keys, ids(0, 3)) == 3  # and a later write succeeds


def test_a_full_disk_is_counted_as_such(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, _ = open_file()

    def no_space(fd: int, buffers: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)
    assert backend.set(chain(2), ids(0, 2)) == 0
    assert backend.stats().failures == {"no_space": 1}
    assert page_files(root) == [] and temp_files(root) == []


def test_a_really_full_file_system_evicts_the_oldest_pages_and_keeps_writing(
    tmp_path: Path,
) -> None:
    reason = tmpfs_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    mount = tmp_path / "small-fs"
    mount.mkdir()
    # A 1 MiB tmpfs holds about 50 pages of 16 KiB; 12 batches of 8 pages overflow it
    # although the backend's cap (1 TB) is never near. No reserve: the kernel's ENOSPC.
    child = run_on_tmpfs(1 << 20, mount, [
        sys.executable, "-m", "tests.full_disk", str(mount / "l3"), "12", "8", "0",
    ])
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    # Every batch was stored whole and read back bit for bit: the kernel's ENOSPC made
    # the backend evict least recently used pages and write again.
    batches = result["batches"]
    assert all((b["stored"], b["read"], b["equal"]) == (8, 8, True) for b in batches)
    assert min(b["free"] for b in batches) < 64 << 10  # the file system did fill up
    failures = result["failures"]
    assert failures["evicted_no_space"] > 0 and "no_space" not in failures, failures
    still = result["still_stored"]
    assert still[-8:] == [1] * 8 and still[:8] == [0] * 8  # the newest kept, the oldest gone
    assert sum(still) == result["files"] < 12 * 8


def _fill_tmpfs(tmp_path: Path, size: int, *args: str) -> dict[str, Any]:
    reason = tmpfs_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    mount = tmp_path / "small-fs"
    mount.mkdir()
    child = run_on_tmpfs(size, mount, [
        sys.executable, "-m", "tests.full_disk", str(mount / "l3"), *args,
    ])
    assert child.returncode == 0, child.stderr
    result: dict[str, Any] = json.loads(child.stdout)
    return result


def test_the_store_leaves_its_reserve_free_and_gives_pages_back_when_the_disk_fills(
    tmp_path: Path,
) -> None:
    # 2 MiB of tmpfs, 512 KiB kept free; half-way another program's file takes 768 KiB.
    reserve, ballast = 512 << 10, 768 << 10
    result = _fill_tmpfs(tmp_path, 2 << 20, "12", "8", str(reserve), str(ballast))
    assert result["min_free"] == reserve
    batches = result["batches"]
    # Every batch was stored whole and read back bit for bit ...
    assert all((b["stored"], b["read"], b["equal"]) == (8, 8, True) for b in batches)
    # ... and no write ever took the reserve: the store evicted its oldest pages first,
    # so the kernel never ran out of space.
    assert all(b["free"] >= reserve for b in batches), [b["free"] for b in batches]
    failures = result["failures"]
    assert failures["evicted_no_space"] > 0 and "no_space" not in failures, failures
    # The other program's file took space back from the cache, not from the reserve.
    assert result["files"] < result["files_before_ballast"]
    still = result["still_stored"]
    assert still[-8:] == [1] * 8 and still[:8] == [0] * 8
    assert sum(still) == result["files"]


def test_a_page_that_would_take_the_reserve_is_a_miss_not_an_error(tmp_path: Path) -> None:
    # A reserve as large as the file system: nothing may be written, and nothing fails.
    result = _fill_tmpfs(tmp_path, 1 << 20, "2", "4", str(1 << 20))
    assert [(b["stored"], b["read"], b["files"]) for b in result["batches"]] == [(0, 0, 0)] * 2
    assert result["failures"] == {"no_space": 2, "missing": 2}  # refused writes, then misses
    assert result["still_stored"] == [0] * 8


def test_the_default_reserve_follows_the_file_system(root: Path, open_file: Opener) -> None:
    backend, _ = open_file()
    disk = os.statvfs(root)
    assert backend.min_free_bytes == default_min_free(disk.f_blocks * disk.f_frsize)
    assert default_min_free(200 * 10**9) == 10 * 10**9  # 5%
    assert default_min_free(1000 * 10**9) == 10 * 2**30  # at most 10 GiB
    assert default_min_free(16 * 10**9) == 2**30  # at least 1 GiB ...
    assert default_min_free(2 * 10**9) == 2 * 10**8  # ... but never over a tenth
    unset, _ = open_file(min_free_bytes=0)
    assert unset.min_free_bytes == 0


def test_enospc_on_rename_evicts_older_pages_never_the_batch_and_retries_once(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_file()
    old, new = chain(1, seed=1), chain(3, seed=2)
    fill_random(host, ids(0, 1), seed=3)
    assert backend.set(old, ids(0, 1)) == 1
    values = fill_random(host, ids(0, 3), seed=4)
    real_replace = os.replace
    calls: list[str] = []

    def full_once(src: Any, dst: Any) -> None:
        calls.append(str(dst))
        if len(calls) == 2:  # the second page of the batch meets a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_once)
    # Room for two pages was wanted; only the old page could go (the batch's first stays).
    assert backend.set(new, ids(0, 3)) == 3
    monkeypatch.undo()
    assert backend.stats().failures == {"evicted_no_space": 1}
    assert backend.exists(old) == 0 and not page_path(root, old[0]).exists()
    assert page_files(root) == sorted(page_path(root, key) for key in new)
    assert temp_files(root) == []
    assert backend.get(new, ids(8, 11)) == 3
    assert page_bytes_of(host, ids(8, 11)) == as_bytes(values)
    backend.check_integrity()


def test_enospc_that_eviction_does_not_cure_is_counted_after_one_retry(
    root: Path, open_file: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, host = open_file()
    fill_random(host, ids(0, 4), seed=5)
    assert backend.set(chain(4, seed=1), ids(0, 4)) == 4
    attempts: list[int] = []

    def no_space(fd: int, buffers: Any) -> int:
        attempts.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)
    assert backend.set(chain(2, seed=2), ids(0, 2)) == 0
    monkeypatch.undo()
    assert len(attempts) == 2  # the write, and one retry after making room
    assert backend.stats().failures == {"evicted_no_space": 2, "no_space": 1}
    assert len(page_files(root)) == 2 and temp_files(root) == []
    backend.check_integrity()


def test_readers_never_see_a_torn_page_while_pages_are_rewritten(root: Path) -> None:
    # Bigger pages so that each write takes a while; a reader in another instance
    # reads the same pages while the writer clears and rewrites them over and over.
    geometry = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)
    writer_host = HostPool(geometry, 8, 16, MemLayout.PAGE_FIRST, pin_memory=False)
    reader_host = HostPool(geometry, 8, 16, MemLayout.PAGE_FIRST, pin_memory=False)
    writer = FileBackend({"path": str(root)})
    reader = FileBackend({"path": str(root)})
    writer.attach(writer_host)
    reader.attach(reader_host)
    keys = [bytes([i]) * 16 for i in range(4)]
    values = fill_random(writer_host, ids(0, 4), seed=3)
    stop = threading.Event()
    reads: list[int] = []

    def read_loop() -> None:
        while not stop.is_set():
            reads.append(reader.get(keys, ids(4, 8)))

    thread = threading.Thread(target=read_loop, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 0.5
        rounds = 0
        while time.monotonic() < deadline or rounds < 5:
            writer.clear()
            assert writer.set(keys, ids(0, 4)) == 4
            rounds += 1
    finally:
        stop.set()
        thread.join(timeout=60)  # a guard against a hang
        writer.close()
    assert not thread.is_alive()
    failures = reader.stats().failures
    # Only ever a whole page or no page: a torn one would be a short read or corrupt.
    assert set(failures) <= {"missing"}, failures
    assert reads and reader.stats().pages_read == sum(reads)
    assert reader.get(keys, ids(4, 8)) == 4
    assert page_bytes_of(reader_host, ids(4, 8)) == as_bytes(values)
    reader.close()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=30, check=True)
    return int(child.stdout)


def test_temporaries_of_crashed_writers_are_removed_at_start_up(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file()
    keys = chain(5)
    fill_random(host, ids(0, 5), seed=4)
    assert backend.set(keys[:1], ids(0, 1)) == 1
    backend.close()
    sub = page_path(root, keys[0]).parent
    name = object_name(keys[1], PayloadOrder.TOKEN_MAJOR)

    def leftover(file_name: str, age_s: float = 0.0) -> Path:
        path = root / name[:2] / file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"HCKV half a page")
        if age_s:
            stamp = time.time() - age_s
            os.utime(path, (stamp, stamp))
        return path

    crashed = leftover(temp_name(name, _dead_pid(), 1))
    running = leftover(temp_name(name, os.getpid(), 2))  # a live writer: ours
    old_running = leftover(temp_name(name, os.getpid(), 3), age_s=STALE_TEMP_AGE_S + 60)
    elsewhere = leftover(temp_name(name, 1, 4, host_tag="0badc0de"))  # another machine's
    old_elsewhere = leftover(
        temp_name(name, 1, 5, host_tag="0badc0de"), age_s=STALE_TEMP_AGE_S + 60
    )
    foreign = leftover(".unrelated.tmp")
    assert sub.exists()

    restarted, _ = open_file()
    assert not crashed.exists() and not old_running.exists() and not old_elsewhere.exists()
    assert not foreign.exists()
    assert running.exists() and elsewhere.exists()
    # Temporaries are never taken for pages.
    assert len(restarted) == 1 and restarted.exists(keys) == 1


# ------------------------------------------------------- size cap and LRU
def test_the_cap_evicts_the_least_recently_used_pages(root: Path, open_file: Opener) -> None:
    backend, host = open_file(max_bytes=3 * FILE_BYTES)
    keys = chain(5)
    fill_random(host, ids(0, 5), seed=5)
    assert backend.set(keys[:3], ids(0, 3)) == 3
    assert backend.get(keys[:1], ids(10, 11)) == 1  # page 0 is now the most recent
    assert backend.set(keys[3:4], ids(3, 4)) == 1  # evicts page 1
    assert [backend.exists([key]) for key in keys[:4]] == [1, 0, 1, 1]
    assert not page_path(root, keys[1]).exists()
    assert backend.set(keys[4:5], ids(4, 5)) == 1  # evicts page 2
    assert [backend.exists([key]) for key in keys] == [1, 0, 0, 1, 1]
    assert len(page_files(root)) == 3 and backend.total_bytes == 3 * FILE_BYTES
    assert backend.stats().failures == {"evicted": 2}
    backend.check_integrity()


def test_a_page_larger_than_the_cap_is_refused(open_file: Opener) -> None:
    backend, _ = open_file(max_bytes=FILE_BYTES - 1)
    assert backend.set(chain(1), ids(0, 1)) == 0
    assert backend.stats().failures == {"over_capacity": 1}


def test_a_restart_finds_the_pages_and_keeps_their_lru_order(
    root: Path, open_file: Opener
) -> None:
    first, host = open_file(max_bytes=3 * FILE_BYTES)
    keys = chain(4)
    values = fill_random(host, ids(0, 4), seed=6)
    assert first.set(keys[:3], ids(0, 3)) == 3
    assert first.get(keys[:1], ids(10, 11)) == 1  # page 0 becomes the most recent
    first.close()

    second, second_host = open_file(max_bytes=3 * FILE_BYTES)
    assert len(second) == 3 and second.total_bytes == 3 * FILE_BYTES
    # The read before the restart counts: page 1, not page 0, is the oldest now.
    second_host.pages[3] = host.pages[3]
    assert second.set(keys[3:4], ids(3, 4)) == 1
    assert [second.exists([key]) for key in keys] == [1, 0, 1, 1]
    assert second.get(keys[2:4], ids(12, 14)) == 2
    assert page_bytes_of(second_host, ids(12, 14)) == as_bytes(values[2:4])
    assert second.get(keys[:1], ids(10, 11)) == 1
    assert page_bytes_of(second_host, ids(10, 11)) == as_bytes(values[:1])
    second.close()
    # Reads in this order left page 2 the oldest, then 3, then 0.
    third, third_host = open_file(max_bytes=3 * FILE_BYTES)
    third_host.pages[1] = host.pages[1]
    assert third.set(keys[1:2], ids(1, 2)) == 1
    assert [third.exists([key]) for key in keys] == [1, 1, 0, 1]


def test_a_restart_under_a_smaller_cap_keeps_the_most_recent_pages(
    root: Path, open_file: Opener
) -> None:
    first, host = open_file()
    keys = chain(4)
    fill_random(host, ids(0, 4), seed=7)
    for i in (2, 0, 3, 1):  # written in this order: 2 oldest, 1 newest
        assert first.set(keys[i : i + 1], ids(i, i + 1)) == 1
    first.close()
    smaller, _ = open_file(max_bytes=2 * FILE_BYTES)
    assert sorted(p.name[:32] for p in page_files(root)) == sorted(
        keys[i].hex() for i in (3, 1)
    )
    assert len(smaller) == 2
    smaller.check_integrity()


# ------------------------------------------------------ shared directories
def test_two_instances_on_one_directory_hit_each_others_pages(
    root: Path, open_file: Opener
) -> None:
    first, first_host = open_file()
    second, second_host = open_file()
    keys = chain(4)
    values = fill_random(first_host, ids(0, 2), seed=8)
    more = fill_random(second_host, ids(2, 4), seed=9)
    assert first.set(keys[:2], ids(0, 2)) == 2
    assert second.set(keys[2:], ids(2, 4)) == 2
    # Each finds the other's pages without a restart, and adopts them.
    assert first.exists(keys) == 4 and second.exists(keys) == 4
    assert first.get(keys, ids(10, 14)) == 4
    assert page_bytes_of(first_host, ids(10, 12)) == as_bytes(values)
    assert page_bytes_of(first_host, ids(12, 14)) == as_bytes(more)
    assert len(first) == 4 and first.total_bytes == 4 * FILE_BYTES


def test_a_page_another_instance_removed_is_written_again(root: Path, open_file: Opener) -> None:
    first, host = open_file()
    second, _ = open_file()
    keys = chain(2)
    fill_random(host, ids(0, 2), seed=10)
    assert first.set(keys, ids(0, 2)) == 2
    assert second.exists(keys) == 2
    second.clear()  # the other instance removes every file (as its eviction would)
    assert first.set(keys, ids(0, 2)) == 2
    assert first.stats().pages_written == 4, "a vanished page was skipped as stored"
    assert len(page_files(root)) == 2


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in page_files(root))


def test_instances_sharing_a_directory_share_its_cap_in_its_lru_order(
    root: Path, open_file: Opener
) -> None:
    # Both attach to the empty directory: neither has seen the other's pages (a router
    # that keeps conversations apart keeps the instances' indexes disjoint like this).
    first, first_host = open_file(max_bytes=4 * FILE_BYTES)
    second, second_host = open_file(max_bytes=4 * FILE_BYTES)
    keys = chain(7)
    fill_random(first_host, ids(0, 7), seed=20)
    values = fill_random(second_host, ids(0, 7), seed=21)
    assert first.set(keys[:3], ids(0, 3)) == 3
    assert second.directory_bytes == 3 * FILE_BYTES
    # The second instance's writes push the directory over the cap: it finds the first
    # instance's pages by a scan and evicts the oldest of the directory, not its own.
    for i in range(3, 6):
        assert second.set(keys[i : i + 1], ids(i, i + 1)) == 1
    assert stored_bytes(root) == 4 * FILE_BYTES == second.directory_bytes
    assert [second.exists([key]) for key in keys[:6]] == [0, 0, 1, 1, 1, 1]
    # The first instance has not seen the second's writes, but the ledger counts them:
    # its next page also evicts the directory's oldest, one of its own written before.
    assert first.set(keys[6:7], ids(6, 7)) == 1
    assert stored_bytes(root) == 4 * FILE_BYTES == first.directory_bytes
    assert [first.exists([key]) for key in keys] == [0, 0, 0, 1, 1, 1, 1]
    assert first.get(keys[3:6], ids(10, 13)) == 3
    assert page_bytes_of(first_host, ids(10, 13)) == as_bytes(values[3:6])
    assert first.stats().failures == {"evicted": 1} and second.stats().failures == {"evicted": 2}
    first.check_integrity()
    second.check_integrity()


def test_instances_writing_at_once_keep_the_cap_and_the_ledger_exact(
    root: Path, open_file: Opener
) -> None:
    cap = 6 * FILE_BYTES
    backends = [open_file(max_bytes=cap) for _ in range(3)]
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        backend, host = backends[index]
        try:
            keys = chain(12, seed=100 + index)
            fill_random(host, ids(0, 12), seed=index)
            for i in range(12):
                assert backend.set(keys[i : i + 1], ids(i, i + 1)) == 1
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # 36 pages went through a cap of 6: no update of the ledger was lost on the way.
    assert stored_bytes(root) <= cap
    assert backends[0][0].directory_bytes == stored_bytes(root)


def test_a_damaged_ledger_is_rebuilt_from_a_scan(root: Path, open_file: Opener) -> None:
    backend, host = open_file(max_bytes=3 * FILE_BYTES)
    keys = chain(4)
    fill_random(host, ids(0, 4), seed=22)
    assert backend.set(keys[:2], ids(0, 2)) == 2
    (root / LEDGER_FILE).write_bytes(b"\x01\x02\x03")  # short: unreadable
    assert backend.directory_bytes is None
    assert backend.set(keys[2:4], ids(2, 4)) == 2
    assert backend.directory_bytes == stored_bytes(root) == 3 * FILE_BYTES
    assert [backend.exists([key]) for key in keys] == [0, 1, 1, 1]
    # A restart counts what is there whatever the ledger said.
    (root / LEDGER_FILE).write_bytes(bytes(16))
    backend.close()
    again, _ = open_file(max_bytes=3 * FILE_BYTES)
    assert again.directory_bytes == 3 * FILE_BYTES and len(again) == 3


def test_a_ledger_that_cannot_be_opened_leaves_the_cap_to_each_instance(
    root: Path, open_file: Opener, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not ours")
    (root / LEDGER_FILE).symlink_to(elsewhere)  # never written through
    backend, host = open_file(max_bytes=2 * FILE_BYTES)
    assert "cannot open the ledger" in caplog.text
    keys = chain(3)
    fill_random(host, ids(0, 3), seed=23)
    assert backend.set(keys, ids(0, 3)) == 3
    assert backend.directory_bytes is None and stored_bytes(root) == 2 * FILE_BYTES
    assert [backend.exists([key]) for key in keys] == [0, 1, 1]
    assert elsewhere.read_bytes() == b"not ours"
    backend.check_integrity()


def test_layouts_with_the_same_row_order_share_pages_and_the_others_do_not(
    open_file: Opener,
) -> None:
    layer_first, lf_host = open_file(MemLayout.LAYER_FIRST)
    direct, direct_host = open_file(MemLayout.PAGE_FIRST_DIRECT)
    page_first, _ = open_file(MemLayout.PAGE_FIRST)
    keys = chain(3)
    values = fill_random(lf_host, ids(0, 3), seed=11)
    assert layer_first.set(keys, ids(0, 3)) == 3
    # page_first_direct stores a page layer-major too: the same objects serve both.
    assert direct.get(keys, ids(5, 8)) == 3
    assert page_bytes_of(direct_host, ids(5, 8)) == as_bytes(values)
    # page_first is token-major: different objects, so a miss rather than garbage.
    assert page_first.exists(keys) == 0


# ----------------------------------------------------------------- integrity
def _stored(open_file: Opener, count: int = 3) -> tuple[FileBackend, HostPool, list[bytes]]:
    backend, host = open_file()
    keys = chain(count)
    fill_random(host, ids(0, count), seed=12)
    assert backend.set(keys, ids(0, count)) == count
    return backend, host, keys


def _rewrite(path: Path, edit: Any) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))


def _flip_payload_byte(data: bytearray) -> bytearray:
    data[100] ^= 0x01
    return data


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_flip_payload_byte, "corrupt"),
        (lambda data: data[: PAGE_BYTES // 2], "short_read"),
        (lambda data: data[:-20], "short_read"),
        (lambda data: data + b"\0", "wrong_length"),
        (lambda data: data[:HEADER_AT] + b"XXXX" + data[HEADER_AT + 4 :], "bad_magic"),
        (lambda data: data[: HEADER_AT + 4] + b"\x09" + data[HEADER_AT + 5 :], "bad_version"),
    ],
    ids=["corrupt", "truncated", "truncated-header", "trailing", "magic", "version"],
)
def test_a_damaged_page_is_a_counted_miss_and_is_dropped(
    root: Path, open_file: Opener, edit: Any, reason: str
) -> None:
    backend, host, keys = _stored(open_file)
    damaged = page_path(root, keys[1])
    _rewrite(damaged, edit)
    assert backend.exists(keys) == 3  # not known to be bad until read
    assert backend.get(keys, ids(10, 13)) == 1  # the prefix before the damaged page
    assert page_bytes_of(host, ids(10, 11)) == page_bytes_of(host, ids(0, 1))
    assert backend.stats().failures == {reason: 1}
    assert not damaged.exists()
    assert backend.exists(keys) == 1
    backend.check_integrity()
    # Dropped, so it can be stored again (not skipped as present).
    assert backend.set(keys, ids(0, 3)) == 3
    assert backend.get(keys, ids(10, 13)) == 3
    assert page_bytes_of(host, ids(10, 13)) == page_bytes_of(host, ids(0, 3))


def test_a_file_holding_another_page_is_a_wrong_key_miss(root: Path, open_file: Opener) -> None:
    backend, _, keys = _stored(open_file)
    # Page 0's object under page 2's name (a misplaced or colliding object).
    page_path(root, keys[2]).write_bytes(page_path(root, keys[0]).read_bytes())
    assert backend.get(keys, ids(10, 13)) == 2
    assert backend.stats().failures == {"wrong_key": 1}
    assert not page_path(root, keys[2]).exists()


def test_a_page_removed_between_exists_and_get_is_a_missing_miss(
    root: Path, open_file: Opener
) -> None:
    backend, _, keys = _stored(open_file)
    assert backend.exists(keys) == 3
    page_path(root, keys[0]).unlink()
    assert backend.get(keys, ids(10, 13)) == 0
    assert backend.stats().failures == {"missing": 1}
    assert backend.exists(keys) == 0 and len(backend) == 2
    backend.check_integrity()


def test_without_checksum_verification_the_header_is_still_checked(
    root: Path, open_file: Opener
) -> None:
    backend, host = open_file(verify_checksum=False)
    keys = chain(2)
    fill_random(host, ids(0, 2), seed=13)
    assert backend.set(keys, ids(0, 2)) == 2
    _rewrite(page_path(root, keys[0]), _flip_payload_byte)
    page_path(root, keys[1]).write_bytes(page_path(root, keys[0]).read_bytes())
    # The flipped byte goes unnoticed (that is what turning the check off means) ...
    assert backend.get(keys, ids(10, 12)) == 1
    assert page_bytes_of(host, ids(10, 11)) != page_bytes_of(host, ids(0, 1))
    # ... but an object under the wrong name is still refused.
    assert backend.stats().failures == {"wrong_key": 1}


# ------------------------------------------------- not a regular file
def _read_with_a_bound(backend: FileBackend, keys: list[bytes], pages: PageIds) -> int | None:
    """``backend.get`` on a helper thread: its answer, or None if it had none in 30 s (a
    FIFO without a writer blocks its reader for good; a busy machine takes its time)."""
    answers: list[int] = []
    reader = threading.Thread(target=lambda: answers.append(backend.get(keys, pages)), daemon=True)
    reader.start()
    reader.join(30.0)
    return answers[0] if answers else None


def test_a_fifo_in_place_of_a_page_file_is_a_quick_miss(root: Path, open_file: Opener) -> None:
    backend, _, keys = _stored(open_file)
    fifo = page_path(root, keys[1])
    fifo.unlink()
    os.mkfifo(fifo)  # what a hung NFS read looks like from here: a read that never returns
    answer = _read_with_a_bound(backend, keys, ids(10, 13))
    if answer is None:  # blocked in open() waiting for a writer: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO page file blocked")
    assert answer == 1
    # Its own reason: not an outage (which would open the circuit breaker).
    assert backend.stats().failures == {"not_regular_file": 1}
    assert backend.exists(keys) == 1  # no longer taken for a stored page
    assert fifo.exists()  # not ours to remove; a later set replaces it with a page
    assert backend.set(keys, ids(0, 3)) == 3
    assert backend.get(keys, ids(10, 13)) == 3
    backend.check_integrity()


def test_a_directory_in_place_of_a_page_file_is_a_miss_not_an_io_error(
    root: Path, open_file: Opener
) -> None:
    backend, _, keys = _stored(open_file)
    page_path(root, keys[0]).unlink()
    page_path(root, keys[0]).mkdir()
    assert _read_with_a_bound(backend, keys, ids(10, 13)) == 0
    assert backend.stats().failures == {"not_regular_file": 1}
    assert backend.exists(keys) == 0
    backend.check_integrity()
