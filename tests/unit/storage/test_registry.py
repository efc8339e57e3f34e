"""Backends by name: lazy imports, install hints for missing dependencies, unknown names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hicache.storage import registry
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.base import StorageError
from hicache.storage.registry import (
    BACKENDS,
    BackendEntry,
    backend_names,
    create_storage_backend,
    unavailable_reason,
)


@pytest.fixture
def fake_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for fake backend modules (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fake_needs_client", "fake_needs_lib", "fake_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(StorageError, match="unknown L3 storage backend 'nfs'") as error:
        create_storage_backend("nfs", {})
    for name in BACKENDS:
        assert name in str(error.value)
    assert unavailable_reason("nfs") == "unknown L3 storage backend 'nfs'"


def test_the_file_backend_by_name_with_its_options(tmp_path: Path) -> None:
    backend = create_storage_backend("file", {"path": str(tmp_path), "max_bytes": "1MiB"})
    assert isinstance(backend, FileBackend)
    assert backend.root == tmp_path and backend.max_bytes == 2**20
    assert unavailable_reason("file") is None
    with pytest.raises(StorageError, match=r"unknown extra-config key.*max_byte"):
        create_storage_backend("file", {"max_byte": 10})


def test_a_missing_client_package_gives_its_install_hint(
    fake_backends: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (fake_backends / "fake_needs_client.py").write_text(
        "from hicache_fake_client.store import Store  # not installed\n"
    )
    entry = BackendEntry(
        "fake_needs_client", "Backend", "a store behind a client library",
        {"hicache_fake_client": "pip install hicache-fake-client"},
    )
    monkeypatch.setitem(BACKENDS, "fake", entry)
    message = "'fake' needs the 'hicache_fake_client' package: pip install hicache-fake-client"
    with pytest.raises(StorageError, match=message):
        create_storage_backend("fake", {})
    reason = unavailable_reason("fake")
    assert reason is not None and "pip install hicache-fake-client" in reason


def test_a_missing_shared_library_gives_the_hints(
    fake_backends: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a compiled client raises when a system library it links against is absent.
    (fake_backends / "fake_needs_lib.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"
    )
    entry = BackendEntry(
        "fake_needs_lib", "Backend", "", {"hicache_fake_client": "apt-get install libfake1"}
    )
    monkeypatch.setitem(BACKENDS, "fake", entry)
    with pytest.raises(StorageError, match=r"cannot load its client library .*libfake1"):
        create_storage_backend("fake", {})


def test_an_unrelated_import_error_is_reported_as_is(
    fake_backends: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (fake_backends / "fake_broken.py").write_text("import hicache_typo_module\n")
    entry = BackendEntry("fake_broken", "Backend", "", {"hicache_fake_client": "pip install x"})
    monkeypatch.setitem(BACKENDS, "fake", entry)
    with pytest.raises(StorageError, match=r"cannot be imported: .*hicache_typo_module"):
        create_storage_backend("fake", {})


def test_the_mooncake_entry_names_the_package_to_install() -> None:
    entry = BACKENDS["mooncake"]
    assert entry.module == "hicache.storage.backends.mooncake.backend"
    assert "mooncake" in entry.install_hints
    assert "pip install" in registry.MOONCAKE_INSTALL_HINT


def test_the_backends_a_wrapper_wraps_are_named_outermost_first() -> None:
    assert backend_names(" File", {"path": "x"}) == ["file"]
    assert backend_names("throttled", {"backend": " Dynamic ", "backend_extra": {}}) == [
        "throttled", "dynamic"]
    nested = {"backend": "throttled", "backend_extra": {"backend": "file"}}
    assert backend_names("Throttled", nested) == ["throttled", "throttled", "file"]
    # A config that names no backend properly wraps none (its settings refuse it).
    assert backend_names("throttled", {}) == ["throttled"]
    assert backend_names("throttled", {"backend": 3}) == ["throttled"]
    assert backend_names("throttled", {"backend": "file", "backend_extra": "x"}) == ["throttled"]
