"""The aibrix backend's own behaviour over a real AIBrix KVCache: options, restarts, damage.

Each test opens AIBrix's cache manager over a fresh directory (its RocksDB L2
lives there) and closes it at the end.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.config import MemLayout
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace
from hicache.storage.base import StorageError, StorageUnavailableError
from hicache.storage.frame import PayloadOrder, object_name
from hicache.storage.registry import create_storage_backend
from tests.dev_dependency import require_dev_dependency
from tests.storage_contract import StorageContract, as_bytes, fill_random, page_bytes_of, page_range

require_dev_dependency("aibrix_kvcache", "pip install 'hicache[aibrix]' (see scripts/bootstrap.sh)")
rocksdict = require_dev_dependency("rocksdict", "pip install 'hicache[aibrix]'")

from hicache.storage.backends.aibrix.backend import AibrixBackend  # noqa: E402 - after the dependency check
from hicache.storage.backends.aibrix.settings import AibrixSettings  # noqa: E402
from hicache.storage.backends.aibrix.store import BlockGeometry  # noqa: E402

_CONTRACT = StorageContract()
NAMESPACE = KeyNamespace("aibrix-test", _CONTRACT.geometry.describe(), _CONTRACT.page_size)


def make_host() -> HostPool:
    return _CONTRACT.make_host(MemLayout.PAGE_FIRST)


def keys(count: int, seed: int = 0) -> list[bytes]:
    return _CONTRACT.keys(NAMESPACE, count, seed=seed)


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[list[AibrixBackend]]:
    """Backends a test opened; every one is closed at the end."""
    backends: list[AibrixBackend] = []
    yield backends
    for backend in backends:
        backend.close()


def options(path: Path, **extra: object) -> dict[str, object]:
    # A generous per-token timeout: RocksDB's answers, not a loaded host's pace, are tested.
    return {"path": str(path), "l1_capacity": "16MiB", "timeout_per_token_ms": 1000, **extra}


def open_backend(
    opened: list[AibrixBackend], path: Path, **extra: object
) -> tuple[AibrixBackend, HostPool]:
    backend = AibrixBackend(options(path, **extra))
    opened.append(backend)
    host = make_host()
    backend.attach(host)
    return backend, host


def rocksdb_dir(backend: AibrixBackend) -> Path:
    """The directory AIBrix's RocksDB connector opened (under our geometry's directory)."""
    found = [p.parent for p in backend.store.rocksdb_root.rglob("CURRENT")]
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------ configuration
def test_options_map_onto_aibrix_environment_variables(tmp_path: Path) -> None:
    backend = AibrixBackend({
        "path": str(tmp_path), "l1_capacity": "512MiB", "l1_eviction_policy": "lru",
        "ttl_s": 0, "timeout_per_token_ms": "250", "verify_checksum": False,
    })
    settings = backend.settings
    assert settings == AibrixSettings(tmp_path, True, 512 * 2**20, "LRU", True, 0, 250)
    env = settings.environment(tmp_path / "x")
    assert env["AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB"] == "0.5"
    assert env["AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY"] == "LRU"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND"] == "ROCKSDB"
    assert env["AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT"] == str(tmp_path / "x")
    assert env["AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S"] == "0"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS"] == "250"
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_TYPE"] == "ALL"
    assert backend.verify_checksum is False


def test_aibrix_environment_variables_are_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT", str(tmp_path / "from-env"))
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB", "2")
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND", "")
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED", "0")
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S", "60")
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS", "75")
    settings = AibrixBackend({}).settings
    assert settings.path == tmp_path / "from-env" and settings.timeout_per_token_ms == 75
    assert settings.l1_capacity_bytes == 2 * 2**30  # AIBrix's variable counts GiB
    assert settings.l1 is False and settings.l2 is True and settings.ttl_s == 60
    # The extra config wins over the environment, in its own units (bytes, not GiB).
    settings = AibrixBackend({"path": str(tmp_path), "l1": True, "l1_capacity": "2"}).settings
    assert settings.path == tmp_path and settings.l1 is True
    assert settings.l1_capacity_bytes == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_bytes": 1}, "unknown extra-config key"),
        ({"l1": False, "l2": False}, "both off"),
        ({"l1_eviction_policy": "random"}, "S3FIFO, LRU, FIFO"),
        ({"l1_capacity": "lots"}, "l1_capacity must be a size"),
        ({"l1_capacity": 0}, "l1_capacity must be > 0"),
        ({"l2": "INFINISTORE"}, "other AIBrix L2 backends are not supported"),
        ({"ttl_s": "soon"}, "ttl_s must be an integer"),
        ({"ttl_s": -1}, "ttl_s must be >= 0"),
        ({"timeout_per_token_ms": 0}, "timeout_per_token_ms must be > 0"),
        ({"timeout_per_token_ms": 1.5}, "timeout_per_token_ms must be an integer"),
        ({"path": 3}, "must be a string"),
    ],
)
def test_bad_options_are_refused_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        create_storage_backend("aibrix", extra)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("hicache.storage.backends.aibrix.backend",
                   "hicache.storage.backends.aibrix.store"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "aibrix_kvcache", None)  # import fails: not installed
    with pytest.raises(StorageError, match=r"aibrix_kvcache.*pip install 'hicache\[aibrix\]'"):
        create_storage_backend("aibrix", {})


def test_the_block_holds_a_framed_page_padded_to_aibrix_s_unit() -> None:
    geometry = BlockGeometry(page_tokens=4, page_bytes=512)
    assert geometry.block_bytes == 560  # 512 + 48 header, a multiple of 2 * 4
    assert BlockGeometry(page_tokens=64, page_bytes=8 * 2**20).block_bytes == 8 * 2**20 + 128


def test_an_unusable_path_is_unavailable_at_attach(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    backend = AibrixBackend({"path": str(blocker)})
    try:
        with pytest.raises(StorageUnavailableError, match="cannot use directory"):
            backend.attach(make_host())
    finally:
        backend.close()


def test_one_path_with_other_settings_in_one_process_is_refused(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    open_backend(opened, tmp_path)
    with pytest.raises(StorageError, match="already open in this process with other settings"):
        open_backend(opened, tmp_path, ttl_s=5)


def test_a_directory_another_process_holds_is_unavailable(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    first, _ = open_backend(opened, tmp_path)
    directory = rocksdb_dir(first)
    first.close()
    # Another process holds RocksDB's lock on the directory (a second server on one path).
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, rocksdict\n"
         "db = rocksdict.Rdict(sys.argv[1], rocksdict.Options(raw_mode=True))\n"
         "print('open', flush=True)\n"
         "time.sleep(60)\n",
         str(directory)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(StorageUnavailableError, match="cannot open the AIBrix cache"):
            open_backend(opened, tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=10)


# ------------------------------------------------------------------ persistence
@pytest.mark.parametrize("l1", [True, False])
def test_pages_in_rocksdb_survive_a_restart(
    tmp_path: Path, opened: list[AibrixBackend], l1: bool
) -> None:
    chain = keys(8, seed=1)
    first, host = open_backend(opened, tmp_path, l1=l1)
    values = fill_random(host, page_range(0, 8), seed=1)
    assert first.set(chain, page_range(0, 8)) == 8
    first.close()  # the last user: AIBrix's manager and RocksDB are closed

    second, other_host = open_backend(opened, tmp_path, l1=l1)
    assert second.exists(chain) == 8
    assert second.get(chain, page_range(20, 28)) == 8
    assert page_bytes_of(other_host, page_range(20, 28)) == as_bytes(values)
    assert second.set(chain, page_range(20, 28)) == 8
    assert second.stats().pages_written == 0  # found in RocksDB, not rewritten
    assert second.stats().failures == {}


def test_the_l1_alone_keeps_pages_for_the_process_only(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    chain = keys(3, seed=2)
    first, host = open_backend(opened, tmp_path, l2=False)
    values = fill_random(host, page_range(0, 3), seed=2)
    assert first.set(chain, page_range(0, 3)) == 3
    assert first.get(chain, page_range(10, 13)) == 3
    assert page_bytes_of(host, page_range(10, 13)) == as_bytes(values)
    assert not any(tmp_path.rglob("CURRENT"))  # no RocksDB was opened
    first.close()
    second, _ = open_backend(opened, tmp_path, l2=False)
    assert second.exists(chain) == 0


# ------------------------------------------------------------------ damage
def rewrite_in_rocksdb(
    backend: AibrixBackend, name: str, change: Callable[[bytearray], None]
) -> None:
    """Close ``backend`` and change one stored value straight in its RocksDB directory."""
    directory = rocksdb_dir(backend)
    backend.close()
    # AIBrix opens its RocksDB with a TTL: open it the same way so values keep their format.
    access = rocksdict.AccessType.with_ttl(600)
    db = rocksdict.Rdict(str(directory), rocksdict.Options(raw_mode=True), access_type=access)
    try:
        value = bytearray(db[name.encode()])
        change(value)
        db[name.encode()] = bytes(value)
    finally:
        db.close()


def test_a_corrupted_page_in_rocksdb_is_a_miss_and_is_dropped(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    chain = keys(5, seed=3)
    first, host = open_backend(opened, tmp_path)
    values = fill_random(host, page_range(0, 5), seed=3)
    assert first.set(chain, page_range(0, 5)) == 5

    def flip(value: bytearray) -> None:
        value[11] ^= 0x20  # one bit of the payload

    rewrite_in_rocksdb(first, object_name(chain[2], PayloadOrder.TOKEN_MAJOR), flip)
    second, other_host = open_backend(opened, tmp_path)
    assert second.exists(chain) == 5  # a lookup does not read the bytes
    assert second.get(chain, page_range(10, 15)) == 2
    assert page_bytes_of(other_host, page_range(10, 12)) == as_bytes(values[:2])
    assert second.stats().failures == {"corrupt": 1}
    assert second.exists(chain) == 2  # dropped from the L1 and from RocksDB
    # Stored again, it reads back whole.
    fill_random(other_host, page_range(0, 5), seed=3)
    assert second.set(chain, page_range(0, 5)) == 5
    assert second.stats().pages_written == 1
    assert second.get(chain, page_range(10, 15)) == 5
    assert page_bytes_of(other_host, page_range(10, 15)) == as_bytes(values)


def test_a_page_stored_under_another_name_is_a_miss(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    chain = keys(2, seed=4)
    first, host = open_backend(opened, tmp_path)
    fill_random(host, page_range(0, 2), seed=4)
    assert first.set(chain, page_range(0, 2)) == 2
    directory = rocksdb_dir(first)
    first.close()
    access = rocksdict.AccessType.with_ttl(600)
    db = rocksdict.Rdict(str(directory), rocksdict.Options(raw_mode=True), access_type=access)
    try:  # page 1's object now holds page 0's frame (a store that mixed up names)
        order = PayloadOrder.TOKEN_MAJOR
        db[object_name(chain[1], order).encode()] = db[object_name(chain[0], order).encode()]
    finally:
        db.close()
    second, _ = open_backend(opened, tmp_path)
    assert second.get(chain, page_range(10, 12)) == 1
    assert second.stats().failures == {"wrong_key": 1}


def test_a_page_damaged_in_the_l1_is_a_miss(tmp_path: Path, opened: list[AibrixBackend]) -> None:
    chain = keys(3, seed=5)
    backend, host = open_backend(opened, tmp_path)
    fill_random(host, page_range(0, 3), seed=5)
    assert backend.set(chain, page_range(0, 3)) == 3
    # Damage page 1's block where AIBrix's L1 keeps it (its own memory, through its API).
    store = backend.store
    name = object_name(chain[1], PayloadOrder.TOKEN_MAJOR)
    status = store.manager.acquire(None, store.hashes([name]))
    assert status.is_ok()
    _, handle = status.get()
    try:
        block = handle.to_tensors()[0].reshape(-1)
        block[5] ^= 1
    finally:
        handle.release()
    assert backend.get(chain, page_range(10, 13)) == 1
    assert backend.stats().failures == {"corrupt": 1}


def test_rocksdb_failing_under_aibrix_is_a_miss_not_an_exception(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    chain = keys(4, seed=6)
    backend, host = open_backend(opened, tmp_path, l1=False)
    fill_random(host, page_range(0, 4), seed=6)
    assert backend.set(chain[:2], page_range(0, 2)) == 2
    # The RocksDB handle goes away under AIBrix (as after an I/O error that closed it).
    backend.store.manager._l2_cache._backend.close()
    began = time.monotonic()
    assert backend.exists(chain) == 0
    assert backend.get(chain, page_range(10, 14)) == 0
    assert backend.set(chain[2:], page_range(2, 4)) == 0
    assert time.monotonic() - began < 30.0  # failed, not retried for long (a busy machine)
    failures = backend.stats().failures
    assert failures.get("io_error", 0) >= 3, failures


def test_clear_reopens_an_empty_store(tmp_path: Path, opened: list[AibrixBackend]) -> None:
    chain = keys(4, seed=7)
    backend, host = open_backend(opened, tmp_path)
    values = fill_random(host, page_range(0, 4), seed=7)
    assert backend.set(chain, page_range(0, 4)) == 4
    backend.clear()
    assert backend.exists(chain) == 0
    assert backend.set(chain, page_range(0, 4)) == 4
    backend.close()
    again, other_host = open_backend(opened, tmp_path)
    assert again.get(chain, page_range(4, 8)) == 4
    assert page_bytes_of(other_host, page_range(4, 8)) == as_bytes(values)


def test_unchanged_pages_keep_their_bytes_across_layout_hosts(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    """Pages written from a layer_first pool are another object than page_first's (frame)."""
    chain = keys(2, seed=8)
    backend = AibrixBackend(options(tmp_path))
    opened.append(backend)
    host = _CONTRACT.make_host(MemLayout.LAYER_FIRST)
    backend.attach(host)
    values = fill_random(host, page_range(0, 2), seed=8)
    assert backend.set(chain, page_range(0, 2)) == 2
    assert backend.get(chain, np.asarray([7, 9])) == 2
    assert page_bytes_of(host, np.asarray([7, 9])) == as_bytes(values)
    page_first, _ = open_backend(opened, tmp_path)
    assert page_first.exists(chain) == 0


def test_loading_the_backend_leaves_asyncio_s_loop_policy_and_turns_pinning_off() -> None:
    """AIBrix installs uvloop's policy on import; the server's own loop must not change."""
    code = (
        "import asyncio\n"
        "before = type(asyncio.get_event_loop_policy())\n"
        "import hicache.storage.backends.aibrix.backend\n"
        "from aibrix_kvcache import cache_manager\n"
        "print(type(asyncio.get_event_loop_policy()) is before, "
        "cache_manager.TESTING_DISABLE_PIN_MEMORY)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["True", "True"]


@pytest.mark.parametrize(("ttl_s", "kept"), [(1, False), (0, True)])
def test_ttl_s_reaches_rocksdb(
    tmp_path: Path, opened: list[AibrixBackend], ttl_s: int, kept: bool
) -> None:
    """RocksDB drops pages older than ttl_s at a compaction; 0 keeps them."""
    chain = keys(1, seed=9)
    backend, host = open_backend(opened, tmp_path, l1=False, ttl_s=ttl_s)
    fill_random(host, page_range(0, 1), seed=9)
    assert backend.set(chain, page_range(0, 1)) == 1
    time.sleep(2.1)  # RocksDB's TTL counts whole seconds
    rocksdb = backend.store.manager._l2_cache._backend.store  # AIBrix's rocksdict handle
    rocksdb.compact_range(None, None)
    assert backend.exists(chain) == (1 if kept else 0)


def test_a_rocksdb_lookup_past_its_timeout_is_a_timeout_miss(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    chain = keys(2, seed=12)
    backend, host = open_backend(opened, tmp_path, l1=False, timeout_per_token_ms=250)
    manager = backend.store.manager
    assert manager._l2_cache_per_token_timeout_ms == 250  # the option reached AIBrix
    fill_random(host, page_range(0, 2), seed=12)
    assert backend.set(chain, page_range(0, 2)) == 2
    assert backend.exists(chain) == 2
    manager._l2_cache_per_token_timeout_ms = 1  # 8 ms for the lookup below

    async def slow_exists(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(1.0)  # far past 2 pages x 4 tokens x 1 ms, however busy the host
        # AIBrix stopped waiting long before: what this would answer never counts.

    manager._l2_cache.exists = slow_exists
    assert backend.exists(chain) == 0
    assert backend.stats().failures.get("timeout", 0) == 1


def test_clear_while_other_threads_read_and_write(
    tmp_path: Path, opened: list[AibrixBackend]
) -> None:
    """clear() swaps AIBrix's manager under running calls: they see pages or misses, no errors."""
    chain = keys(8, seed=10)
    backend, host = open_backend(opened, tmp_path)
    fill_random(host, page_range(0, 8), seed=10)
    stop = threading.Event()
    errors: list[BaseException] = []
    answers: list[int] = []

    def worker(offset: int) -> None:
        try:
            while not stop.is_set():
                answers.append(backend.set(chain, page_range(0, 8)))
                answers.append(backend.get(chain, page_range(20 + 8 * offset, 28 + 8 * offset)))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(5):
            # The scenario, not a wait for an event: clears spaced out among the writers' calls.
            time.sleep(0.05)
            backend.clear()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)  # a guard against a hang
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    assert answers and all(0 <= n <= 8 for n in answers)
    assert backend.set(chain, page_range(0, 8)) == 8  # usable afterwards
    assert backend.get(chain, page_range(40, 48)) == 8
