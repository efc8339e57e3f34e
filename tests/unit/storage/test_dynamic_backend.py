"""The "dynamic" backend: a store class named by module path and class name.

The store classes the tests load live in this module (imported by its dotted
name, or from its file path): a duck-typed dict store with stats (the one the
contract suite runs against, in test_contract_dynamic.py), a bare one without
stats or close, a StorageBackend subclass, and classes of the wrong shape.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.dynamic.backend import DynamicBackend
from hicache.storage.base import StorageBackend, StorageError, StorageStats
from hicache.storage.registry import create_storage_backend

MODULE = __name__
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)

# Named stores shared by every DictStore built with the same "store" option.
STORES: dict[str, dict[bytes, torch.Tensor]] = {}
_STORES_LOCK = threading.Lock()


class DictStore:
    """A store with the backend's shape but no StorageBackend base class."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)
        with _STORES_LOCK:
            self.pages = STORES.setdefault(str(options["store"]), {})
        self.lock = threading.Lock()
        self.counters = StorageStats()
        self.host: HostPool | None = None
        self.closed = 0

    def attach(self, host: HostPool) -> None:
        self.host = host

    def close(self) -> None:
        self.closed += 1

    def exists(self, keys: Sequence[bytes]) -> int:
        with self.lock:
            self.counters.exists_queries += 1
            for i, key in enumerate(keys):
                if key not in self.pages:
                    return i
        return len(keys)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        assert self.host is not None
        for i, (key, page) in enumerate(zip(keys, host_pages, strict=True)):
            with self.lock:
                value = self.pages.get(key)
                if value is None:
                    self.counters.fail("missing")
                    return i
                self.counters.pages_read += 1
                self.counters.bytes_read += self.host.page_bytes
            self.host.pages[int(page)] = value
        return len(keys)

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        assert self.host is not None
        for key, page in zip(keys, host_pages, strict=True):
            with self.lock:
                if key in self.pages:
                    self.counters.pages_skipped_existing += 1
                    continue
                self.pages[key] = self.host.pages[int(page)].clone()
                self.counters.pages_written += 1
                self.counters.bytes_written += self.host.page_bytes
        return len(keys)

    def clear(self) -> None:
        with self.lock:
            self.pages.clear()

    def discard(self, keys: Sequence[bytes]) -> int:
        with self.lock:
            for key in keys:
                self.counters.fail("corrupt")
                self.pages.pop(key, None)
        return len(keys)

    def stats(self) -> StorageStats:
        with self.lock:
            return self.counters.snapshot()


class BareStore:
    """The minimal shape: no close(), no stats(); answers say everything was found."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)
        self.calls: list[tuple[str, int]] = []

    def attach(self, host: HostPool) -> None:
        self.calls.append(("attach", host.num_pages))

    def exists(self, keys: Sequence[bytes]) -> int:
        self.calls.append(("exists", len(keys)))
        return len(keys)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self.calls.append(("get", len(keys)))
        return int(self.options.get("get_answer", len(keys)))

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self.calls.append(("set", len(keys)))
        return len(keys) + 5  # over-answering: clamped by the wrapper

    def clear(self) -> None:
        self.calls.append(("clear", 0))


class SubclassStore(StorageBackend):
    """A StorageBackend subclass that remembers its options and stores nothing."""

    name = "subclass-store"

    def exists(self, keys: Sequence[bytes]) -> int:
        self._check_args(keys)
        with self._lock:
            self._stats.exists_queries += 1
        return 0

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        return 0

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        return 0

    def clear(self) -> None:
        pass


class HalfDoneSubclass(StorageBackend):
    def exists(self, keys: Sequence[bytes]) -> int:
        return 0


class NoGet:
    def __init__(self, options: Mapping[str, Any]) -> None:
        pass

    def attach(self, host: HostPool) -> None:
        pass

    def exists(self, keys: Sequence[bytes]) -> int:
        return 0

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        return 0


class GetIsData(BareStore):
    get = 3  # type: ignore[assignment]


class GetTakesOneArgument(BareStore):
    def get(self, keys: Sequence[bytes]) -> int:  # type: ignore[override]
        return 0


class ConstructorTakesNothing(BareStore):
    def __init__(self) -> None:
        super().__init__({})


class ConstructorFails(BareStore):
    def __init__(self, options: Mapping[str, Any]) -> None:
        raise ValueError("no endpoint configured")


class AnswersNone(BareStore):
    def exists(self, keys: Sequence[bytes]) -> int:
        return None  # type: ignore[return-value]


def not_a_class(options: Mapping[str, Any]) -> None:
    pass


def dynamic(class_name: str, module_path: str = MODULE, **options: Any) -> DynamicBackend:
    return DynamicBackend({"module_path": module_path, "class_name": class_name, **options})


@pytest.fixture
def host() -> HostPool:
    return HostPool(GEOMETRY, 16, 2, MemLayout.PAGE_FIRST, pin_memory=False)


def keys_of(count: int, first: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(first, first + count)]


def pages(*ids: int) -> PageIds:
    return np.asarray(ids, dtype=np.int64)


def test_the_registry_builds_it_and_the_class_gets_the_other_options(
    host: HostPool, tmp_path: Path
) -> None:
    backend = create_storage_backend(
        "dynamic",
        {"module_path": MODULE, "class_name": "DictStore", "store": str(tmp_path), "zone": "a"},
    )
    assert isinstance(backend, DynamicBackend)
    assert isinstance(backend.inner, DictStore)
    assert backend.inner.options == {"store": str(tmp_path), "zone": "a"}
    backend.attach(host)
    host.pages[0] = 1.5
    assert backend.set(keys_of(1), pages(0)) == 1
    assert backend.get(keys_of(1), pages(1)) == 1
    assert torch.equal(host.pages[1], host.pages[0])
    assert backend.stats().pages_written == 1  # the class's own stats
    backend.close()
    backend.close()
    assert backend.inner.closed == 1


def test_a_class_from_a_file_path(host: HostPool, tmp_path: Path) -> None:
    path = tmp_path / "my_store.py"
    path.write_text(
        "class Store:\n"
        "    def __init__(self, options):\n"
        "        self.options = options\n"
        "    def attach(self, host):\n"
        "        self.host = host\n"
        "    def exists(self, keys):\n"
        "        return 0\n"
        "    def get(self, keys, host_pages):\n"
        "        return 0\n"
        "    def set(self, keys, host_pages):\n"
        "        return len(keys)\n"
        "    def clear(self):\n"
        "        pass\n"
    )
    backend = dynamic("Store", str(path), region="eu")
    backend.attach(host)
    assert backend.inner.options == {"region": "eu"}
    assert backend.set(keys_of(3), pages(0, 1, 2)) == 3
    assert backend.exists(keys_of(3)) == 0
    # Loading the file again gives the same module, not a second copy.
    assert type(dynamic("Store", str(path)).inner) is type(backend.inner)
    backend.close()


def test_a_bare_class_is_guarded_and_counted_by_the_wrapper(host: HostPool) -> None:
    backend = dynamic("BareStore", get_answer=1)
    inner = backend.inner
    with pytest.raises(StorageError, match="before attach"):
        backend.exists(keys_of(1))
    assert inner.calls == []
    backend.attach(host)
    assert isinstance(inner, BareStore)
    assert backend.exists(keys_of(4)) == 4
    assert backend.set(keys_of(2), pages(0, 1)) == 2  # its over-answer is clamped
    assert backend.get(keys_of(3), pages(2, 3, 4)) == 1
    stats = backend.stats()
    assert stats.exists_queries == 1
    assert stats.pages_written == 2 and stats.bytes_written == 2 * host.page_bytes
    assert stats.pages_read == 1 and stats.bytes_read == host.page_bytes
    assert stats.failures == {"missing": 1}
    # Malformed calls never reach the class.
    calls = list(inner.calls)
    with pytest.raises(StorageError, match="at most"):
        backend.exists(keys_of(129))
    with pytest.raises(StorageError, match="host pages"):
        backend.get(keys_of(2), pages(0))
    assert inner.calls == calls
    backend.close()  # no close() on the class: nothing to call
    with pytest.raises(StorageError, match="close"):
        backend.exists(keys_of(1))
    assert inner.calls == calls


def test_a_storage_backend_subclass_is_used_as_is(host: HostPool) -> None:
    backend = dynamic("SubclassStore", endpoint="x")
    assert isinstance(backend.inner, SubclassStore)
    assert backend.inner.extra_config == {"endpoint": "x"}
    backend.attach(host)
    assert backend.inner.host is host
    assert backend.exists(keys_of(2)) == 0
    assert backend.stats().exists_queries == 1
    backend.close()


def test_a_non_integer_answer_is_the_class_bug(host: HostPool) -> None:
    backend = dynamic("AnswersNone")
    backend.attach(host)
    with pytest.raises(StorageError, match=r"exists\(\) must return an int"):
        backend.exists(keys_of(1))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"class_name": "DictStore"}, "needs 'module_path'"),
        ({"module_path": MODULE}, "needs 'class_name'"),
        ({"module_path": MODULE, "class_name": 7}, "needs 'class_name'"),
        ({"module_path": "hicache_no_such_pkg.stores", "class_name": "X"}, "no module"),
        ({"module_path": "/nonexistent/dir/store.py", "class_name": "X"}, "is not a file"),
    ],
)
def test_a_bad_configuration_is_a_clear_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StorageError, match=message):
        DynamicBackend(options)


@pytest.mark.parametrize(
    ("class_name", "message"),
    [
        ("Missing", r"no 'Missing'.*DictStore"),
        ("not_a_class", "not a class"),
        ("HalfDoneSubclass", "does not implement clear, get, set"),
        ("NoGet", r"lacks get, clear; .*get\(keys, host_pages\)"),
        ("GetIsData", "GetIsData.get is not a method"),
        ("GetTakesOneArgument", r"cannot be called as get\(keys, host_pages\)"),
        ("ConstructorTakesNothing", "raised TypeError"),
        ("ConstructorFails", "no endpoint configured"),
    ],
)
def test_a_class_of_the_wrong_shape_is_a_clear_error(class_name: str, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        dynamic(class_name)


def test_a_module_that_fails_to_import_is_reported(tmp_path: Path) -> None:
    broken = tmp_path / "broken_store.py"
    broken.write_text("import hicache_absent_dependency_xyz\n")
    with pytest.raises(StorageError, match=r"importing .* failed: .*hicache_absent_dependency_xyz"):
        dynamic("Store", str(broken))
    crashing = tmp_path / "crashing_store.py"
    crashing.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(StorageError, match="RuntimeError: bad module"):
        dynamic("Store", str(crashing))
    # A failed load leaves nothing behind: fixed, it loads.
    crashing.write_text("class Store:\n    pass\n")
    with pytest.raises(StorageError, match="lacks attach, exists, get, set, clear"):
        dynamic("Store", str(crashing))
