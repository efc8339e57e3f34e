"""The nixl backend beyond the contract: configuration errors, missing plugins and package,
damaged files, a directory that is gone, a transfer past its deadline, and sharing files
with the file backend.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageError
from hicache.storage.frame import HEADER_BYTES, PayloadOrder, object_name
from hicache.storage.page_files import temp_name
from hicache.storage.registry import create_storage_backend
from tests.nixl_fixtures import require_nixl
from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range

require_nixl()

from hicache.storage.backends.nixl.agent import NixlAgent, TransferFailed  # noqa: E402
from hicache.storage.backends.nixl.backend import NixlBackend  # noqa: E402
from hicache.storage.backends.nixl.settings import DIRECT_ALIGN_BYTES  # noqa: E402

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
# Regions of 8 tokens x 512-byte rows: 4096 bytes, as O_DIRECT needs.
ALIGNED_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
PAGE_SIZE = 4
ALIGNED_PAGE_SIZE = 8


def make_host(
    layout: MemLayout = MemLayout.PAGE_FIRST, geometry: KVGeometry = GEOMETRY,
    page_size: int = PAGE_SIZE,
) -> HostPool:
    return HostPool(geometry, 32, page_size, layout, pin_memory=False)


def keys_of(count: int, page_size: int = PAGE_SIZE, seed: int = 0) -> list[bytes]:
    namespace = KeyNamespace(f"nixl-test-{seed}", GEOMETRY.describe(), page_size)
    tokens = np.random.default_rng(seed).integers(0, 32000, count * page_size)
    return chain_page_keys(pack_tokens(tokens), page_size, namespace.seed(None))


def page_path(root: Path, key: bytes, layout: MemLayout = MemLayout.PAGE_FIRST) -> Path:
    name = object_name(key, PayloadOrder.of_layout(layout))
    return root / name[:2] / name


def opened(root: Path, host: HostPool, **extra: Any) -> NixlBackend:
    backend = NixlBackend({"path": str(root), **extra})
    backend.attach(host)
    return backend


# ------------------------------------------------------------------ configuration
def test_created_by_name_with_its_options(tmp_path: Path) -> None:
    backend = create_storage_backend(
        "nixl", {"path": str(tmp_path), "io_queue": "URING", "verify_checksum": False,
                 "transfer_timeout_s": 2.5},
    )
    assert isinstance(backend, NixlBackend)
    settings = backend.settings
    assert settings.path == tmp_path and settings.plugin == "POSIX"
    assert settings.io_queue.value == "uring" and not settings.verify_checksum
    assert settings.transfer_timeout_s == 2.5 and settings.trailer_bytes == HEADER_BYTES
    backend.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_bytes": 10}, r"unknown extra-config key\(s\) max_bytes"),
        ({"plugin": "UCX"}, r"plugin must be one of POSIX, GDS, GDS_MT, got 'UCX'"),
        ({"plugin": "OBJ"}, r"plugin 'OBJ' stores S3 objects"),
        ({"io_queue": "epoll"}, r"io_queue must be one of auto, aio, uring, posix_aio"),
        ({"direct_io": "sometimes"}, r"direct_io must be true or false"),
        ({"transfer_timeout_s": 0}, r"transfer_timeout_s must be a number >= 0.001"),
        ({"path": 3}, r"path must be a string"),
    ],
)
def test_configuration_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        NixlBackend(extra)


def test_a_plugin_this_machine_cannot_load_is_a_clear_error() -> None:
    # GDS ships with NIXL but needs CUDA and cuFile: absent on a CPU-only machine.
    if torch.cuda.is_available():
        pytest.skip("a GPU machine may load the GDS plugin")
    with pytest.raises(StorageError, match=r"GDS plugin cannot be loaded.*GPUDirect Storage"):
        NixlBackend({"plugin": "gds"})
    with pytest.raises(StorageError, match="io_queue applies to the POSIX plugin only"):
        NixlBackend({"plugin": "GDS", "io_queue": "aio"})


def test_a_plugin_nixl_does_not_have_lists_the_ones_it_has() -> None:
    with pytest.raises(StorageError, match=r"no 'NOPE' plugin here \(it has .*POSIX"):
        NixlAgent("NOPE", {})


def test_a_missing_nixl_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = [name for name in sys.modules if name.split(".")[0] in ("nixl", "nixl_cu12")]
    for name in {"nixl", "nixl_cu12", *loaded}:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    for name in ("hicache.storage.backends.nixl.backend", "hicache.storage.backends.nixl.agent"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(StorageError, match=r"needs the 'nixl_cu12' package: pip install "
                       r"'hicache\[nixl\]'"):
        create_storage_backend("nixl", {})


def test_direct_io_refuses_a_pool_it_cannot_use_without_copies(tmp_path: Path) -> None:
    backend = NixlBackend({"path": str(tmp_path), "direct_io": True})
    try:
        assert backend.settings.trailer_bytes == DIRECT_ALIGN_BYTES
        with pytest.raises(StorageError, match="direct_io needs every page region at a 4096"):
            backend.attach(make_host())  # 512-byte pages
    finally:
        backend.close()


# ------------------------------------------------------------------ damaged files
@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_a_corrupted_page_ends_the_prefix_and_is_removed(
    tmp_path: Path, layout: MemLayout
) -> None:
    host = make_host(layout)
    backend = opened(tmp_path, host)
    try:
        keys = keys_of(4)
        values = fill_random(host, page_range(0, 4), seed=1)
        assert backend.set(keys, page_range(0, 4)) == 4
        damaged = page_path(tmp_path, keys[2], layout)
        data = bytearray(damaged.read_bytes())
        data[100] ^= 0x01  # one bit of the payload
        damaged.write_bytes(bytes(data))
        assert backend.get(keys, page_range(10, 14)) == 2
        assert page_bytes_of(host, page_range(10, 12)) == as_bytes(values[:2])
        assert backend.stats().failures == {"corrupt": 1}
        assert not damaged.exists()  # dropped, so that a later set() stores it again
        assert backend.exists(keys) == 2
        assert backend.set(keys, page_range(0, 4)) == 4
        assert backend.get(keys, page_range(10, 14)) == 4
        assert page_bytes_of(host, page_range(10, 14)) == as_bytes(values)
    finally:
        backend.close()


def test_a_header_naming_another_page_and_a_truncated_file_are_misses(tmp_path: Path) -> None:
    host = make_host()
    backend = opened(tmp_path, host)
    try:
        keys = keys_of(3)
        fill_random(host, page_range(0, 3), seed=2)
        assert backend.set(keys, page_range(0, 3)) == 3
        # Page 0's file under page 1's name: right size and checksum, wrong key.
        shutil.copyfile(page_path(tmp_path, keys[0]), page_path(tmp_path, keys[1]))
        assert backend.get(keys, page_range(10, 13)) == 1
        assert backend.stats().failures == {"wrong_key": 1}
        assert backend.set(keys, page_range(0, 3)) == 3
        truncated = page_path(tmp_path, keys[0])
        truncated.write_bytes(truncated.read_bytes()[:-1])
        assert backend.get(keys, page_range(10, 13)) == 0
        assert backend.stats().failures == {"wrong_key": 1, "short_read": 1}
        assert not truncated.exists()
    finally:
        backend.close()


def test_a_directory_that_is_gone_gives_misses_not_exceptions(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    host = make_host()
    backend = opened(root, host)
    try:
        keys = keys_of(3)
        fill_random(host, page_range(0, 3), seed=3)
        assert backend.set(keys, page_range(0, 3)) == 3
        shutil.rmtree(root)
        root.write_bytes(b"not a directory")  # the store is unusable, not merely empty
        assert backend.exists(keys) == 0
        assert backend.get(keys, page_range(10, 13)) == 0
        assert backend.set(keys, page_range(0, 3)) == 0
        failures = backend.stats().failures
        assert failures.get("io_error", 0) >= 3 and "missing" not in failures
        backend.clear()  # nothing to clear: no exception either
    finally:
        backend.close()


class _NeverDone:
    """A NIXL agent whose transfers never complete (a stuck device), for the deadline."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.released = 0

    def transfer(self, handle: Any) -> str:
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        return "PROC"

    def release_xfer_handle(self, handle: Any) -> None:
        self.released += 1
        self._agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def test_a_transfer_past_its_deadline_fails_the_batch(tmp_path: Path) -> None:
    host = make_host()
    keys = keys_of(4)
    fill_random(host, page_range(0, 4), seed=4)
    # The pages are stored under the default deadline: a short one would also bound this
    # real write, which a loaded machine can take past it.
    writer = opened(tmp_path, host)
    try:
        assert writer.set(keys, page_range(0, 4)) == 4
    finally:
        writer.close()
    backend = opened(tmp_path, host, transfer_timeout_s=0.05)
    try:
        stuck = _NeverDone(backend._agent._agent)
        backend._agent._agent = stuck
        began = time.monotonic()
        assert backend.get(keys, page_range(10, 14)) == 0
        assert backend.set(keys_of(2, seed=9), page_range(0, 2)) == 0
        # The transfers never finish: only their deadline ends them (a busy machine's margin).
        assert time.monotonic() - began < 20.0
        assert backend.stats().failures == {"timeout": 6}
        assert stuck.released == 2  # each request was cancelled and freed
        # No temporary of the failed write is left behind.
        assert not [p for p in tmp_path.rglob(".*") if p.is_file()]
    finally:
        backend._agent._agent = getattr(backend._agent._agent, "_agent", backend._agent._agent)
        backend.close()


def test_agent_transfer_raises_on_a_plugin_error(tmp_path: Path) -> None:
    host = make_host()
    backend = opened(tmp_path, host)
    try:
        path = tmp_path / "short"
        path.write_bytes(b"x" * 10)
        fd = os.open(path, os.O_RDONLY)
        try:
            memory = np.array([[host.flat.data_ptr(), 512, 0]], dtype=np.uint64)
            files = np.array([[0, 512, fd]], dtype=np.uint64)
            with pytest.raises(TransferFailed) as failure:
                backend._agent.transfer("READ", memory, files, [fd], 512, 5.0)
            assert failure.value.reason == "io_error"
        finally:
            os.close(fd)
    finally:
        backend.close()


# ------------------------------------------------------------------ files and modes
def test_stale_temporaries_are_removed_at_attach(tmp_path: Path) -> None:
    sub = tmp_path / "ab"
    sub.mkdir(parents=True)
    dead = sub / temp_name("ab" + "0" * 30 + ".tm", 2**22 + 12345, 1)  # no such process
    live = sub / temp_name("ab" + "1" * 30 + ".tm", os.getpid(), 2)
    dead.write_bytes(b"half a page")
    live.write_bytes(b"being written")
    backend = opened(tmp_path, make_host())
    try:
        assert not dead.exists() and live.exists()
    finally:
        backend.close()


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_buffered_files_are_the_file_backends_files(tmp_path: Path, layout: MemLayout) -> None:
    host = make_host(layout)
    nixl = opened(tmp_path, host)
    files = FileBackend({"path": str(tmp_path)})
    files.attach(host)
    try:
        first, second = keys_of(3, seed=5), keys_of(3, seed=6)
        values = fill_random(host, page_range(0, 6), seed=5)
        assert nixl.set(first, page_range(0, 3)) == 3
        assert files.set(second, page_range(3, 6)) == 3
        assert files.get(first, page_range(10, 13)) == 3
        assert nixl.get(second, page_range(13, 16)) == 3
        assert page_bytes_of(host, page_range(10, 16)) == as_bytes(values)
        assert nixl.stats().failures == {} and files.stats().failures == {}
    finally:
        files.close()
        nixl.close()


def test_direct_io_pages_are_block_aligned_and_other_modes_miss_them(tmp_path: Path) -> None:
    host = make_host(geometry=ALIGNED_GEOMETRY, page_size=ALIGNED_PAGE_SIZE)
    direct = opened(tmp_path, host, direct_io=True, io_queue="uring")
    buffered = opened(tmp_path, host)
    try:
        keys = keys_of(2, page_size=ALIGNED_PAGE_SIZE)
        values = fill_random(host, page_range(0, 2), seed=7)
        assert direct.set(keys, page_range(0, 2)) == 2
        size = page_path(tmp_path, keys[0]).stat().st_size
        assert size == host.page_bytes + DIRECT_ALIGN_BYTES and size % DIRECT_ALIGN_BYTES == 0
        assert direct.get(keys, page_range(10, 12)) == 2
        assert page_bytes_of(host, page_range(10, 12)) == as_bytes(values)
        # A buffered instance sees a file of the wrong length: a miss, removed.
        assert buffered.exists(keys) == 0
        assert buffered.get(keys, page_range(20, 22)) == 0
        assert buffered.stats().failures == {"wrong_length": 1}
    finally:
        buffered.close()
        direct.close()


def test_direct_io_on_a_file_system_without_o_direct_is_refused_at_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hicache.storage.backends.nixl.backend as nixl_module

    def refuse(path: str, flags: int) -> int:
        raise OSError(22, "Invalid argument")  # what open(O_DIRECT) says on such a mount

    monkeypatch.setattr(nixl_module, "create_file", refuse)
    backend = NixlBackend({"path": str(tmp_path), "direct_io": True})
    try:
        host = make_host(geometry=ALIGNED_GEOMETRY, page_size=ALIGNED_PAGE_SIZE)
        with pytest.raises(StorageError, match="refuses O_DIRECT"):
            backend.attach(host)
    finally:
        backend.close()


def test_clear_removes_pages_and_leaves_what_is_not_ours(tmp_path: Path) -> None:
    host = make_host()
    backend = opened(tmp_path, host)
    try:
        keys = keys_of(3)
        fill_random(host, page_range(0, 3), seed=8)
        assert backend.set(keys, page_range(0, 3)) == 3
        sub = page_path(tmp_path, keys[0]).parent
        live = sub / temp_name(page_path(tmp_path, keys[0]).name, os.getpid(), 7)
        foreign = sub / "notes.txt"
        live.write_bytes(b"being written")
        foreign.write_bytes(b"someone else's")
        backend.clear()
        assert backend.exists(keys) == 0
        assert not any(page_path(tmp_path, key).exists() for key in keys)
        assert live.exists() and foreign.exists()
    finally:
        backend.close()


def test_direct_io_trailers_are_the_header_then_zeros(tmp_path: Path) -> None:
    host = make_host(geometry=ALIGNED_GEOMETRY, page_size=ALIGNED_PAGE_SIZE)
    backend = opened(tmp_path, host, direct_io=True)
    try:
        first = keys_of(1, ALIGNED_PAGE_SIZE, seed=10)
        second = keys_of(1, ALIGNED_PAGE_SIZE, seed=11)
        fill_random(host, page_range(0, 2), seed=10)
        assert backend.set(first, page_range(0, 1)) == 1
        stored = page_path(tmp_path, first[0])
        data = bytearray(stored.read_bytes())
        data[-1] = 0xFF  # junk in the padding: not checked, but it lands in a trailer slot
        stored.write_bytes(bytes(data))
        assert backend.get(first, page_range(10, 11)) == 1
        assert backend.set(second, page_range(1, 2)) == 1  # reuses that slot
        trailer = page_path(tmp_path, second[0]).read_bytes()[host.page_bytes:]
        assert len(trailer) == DIRECT_ALIGN_BYTES
        assert trailer[:4] == b"HCKV"
        assert trailer[HEADER_BYTES:] == bytes(len(trailer) - HEADER_BYTES)
    finally:
        backend.close()
