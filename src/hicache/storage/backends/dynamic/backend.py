"""The "dynamic" backend: an L3 store class of your own, named in the extra config.

Extra config:
    module_path  where the class lives: a dotted module name importable by the server
                 (``my_company.kv_store``) or the path of a ``.py`` file
    class_name   the class in that module
    any other key is the class's own: it is constructed as ``class_name(rest)`` with
    the remaining keys as one dict (what ``StorageBackend.__init__`` takes)

The class should subclass ``StorageBackend`` (it then gets the argument
checks, the stats counters and the ``host`` property for free). A class that
does not may still be used if it has the same shape: callable ``attach(host)``,
``exists(keys)``, ``get(keys, host_pages)``, ``set(keys, host_pages)`` and
``clear()``, optionally ``close()`` and ``stats()`` (returning a
``StorageStats``). The shape is checked when the backend is created, before
any page moves, and a ``StorageError`` names what is missing or wrong.

``DynamicBackend`` wraps the instance: it checks every call's arguments
against the contract (batch size, key length, host page range, use after
close) so the class never sees a malformed call, and clamps answers to
``0..len(keys)``. For a class without ``stats()`` it counts what the answers
show: lookups, pages read, short reads (as "missing"), and pages stored by
``set`` as written (a bare answer cannot tell written from already there).

Pins: a class whose ``supports_pins`` is true and that has callable ``pin(keys,
until_unix_s)`` and ``unpin(keys)`` pins through the wrapper; any other cannot pin.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageBackend, StorageError, StorageStats
from hicache.storage.failure_reasons import FailureReason
from hicache.tenancy.quotas import TenantQuotas

# Method name -> the arguments a call passes (after self), for the shape check.
REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "attach": ("host",),
    "exists": ("keys",),
    "get": ("keys", "host_pages"),
    "set": ("keys", "host_pages"),
    "clear": (),
}
OPTIONAL_METHODS: dict[str, tuple[str, ...]] = {"close": (), "stats": ()}
_SOURCE = "dynamic storage"


class DynamicBackend(StorageBackend):
    """See the module docstring."""

    name = "dynamic"

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        rest = dict(self.extra_config)
        module_path = _required_string(rest.pop("module_path", None), "module_path")
        class_name = _required_string(rest.pop("class_name", None), "class_name")
        self.target = f"{module_path}:{class_name}"
        backend_class = load_class(module_path, class_name)
        check_class(backend_class, self.target)
        try:
            instance = backend_class(rest)
        except StorageError:
            raise
        except Exception as error:
            raise StorageError(
                f"{_SOURCE}: {self.target}({rest!r}) raised {type(error).__name__}: {error}"
            ) from error
        check_instance(instance, self.target)
        self.inner: Any = instance
        self._has_stats = callable(getattr(instance, "stats", None))
        self.supports_pins = getattr(instance, "supports_pins", False) is True and all(
            callable(getattr(instance, method, None)) for method in ("pin", "unpin"))

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self.inner.attach(host)
        super().attach(host)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        self._ready(keys)
        found = self._clamp(self.inner.exists(keys), keys, "exists")
        if not self._has_stats:
            self._count_exists_query()
        return found

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self._ready(keys, host_pages)
        began = time.perf_counter()
        num_read = self._clamp(self.inner.get(keys, host_pages), keys, "get")
        if not self._has_stats:
            self._count_read(num_read, self.page_bytes, began)
            if num_read < len(keys):
                self._fail(FailureReason.MISSING)
        return num_read

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self._ready(keys, host_pages)
        began = time.perf_counter()
        num_stored = self._clamp(self.inner.set(keys, host_pages), keys, "set")
        if not self._has_stats:
            self._count_write(num_stored, 0, self.page_bytes, began)
        return num_stored

    def discard(self, keys: Sequence[bytes]) -> int:
        self._ready(keys)
        if not self._has_stats and keys:
            self._fail(FailureReason.CORRUPT, len(keys))
        discard = getattr(self.inner, "discard", None)
        if callable(discard) and keys:
            discard(keys)
        return len(keys)

    def clear(self) -> None:
        self._ready([])
        self.inner.clear()

    def pin(self, keys: Sequence[bytes], until_unix_s: float) -> int:
        self._ready(keys)
        if not self.supports_pins:
            return super().pin(keys, until_unix_s)  # refused: it cannot pin
        return self._clamp(self.inner.pin(keys, until_unix_s), keys, "pin")

    def unpin(self, keys: Sequence[bytes]) -> int:
        self._ready(keys)
        if not self.supports_pins:
            return super().unpin(keys)
        return self._clamp(self.inner.unpin(keys), keys, "unpin")

    # Tenants: forwarded to a class that defines them (a StorageBackend subclass does);
    # otherwise the contract's defaults (no usage, no purge).
    def set_tenant_quotas(self, quotas: TenantQuotas | None) -> None:
        super().set_tenant_quotas(quotas)
        forward = getattr(self.inner, "set_tenant_quotas", None)
        if callable(forward):
            forward(quotas)

    def tenant_usage(self) -> dict[str | None, int] | None:
        usage = getattr(self.inner, "tenant_usage", None)
        if not callable(usage):
            return None
        value = usage()
        if value is not None and not isinstance(value, dict):
            raise StorageError(f"{_SOURCE}: {self.target}.tenant_usage() must return a dict "
                               f"or None, got {type(value).__name__}")
        return value

    def purge_tenant(self, tenant: str | None) -> int:
        self._ready([])
        purge = getattr(self.inner, "purge_tenant", None)
        if not callable(purge):
            return super().purge_tenant(tenant)
        value = purge(tenant)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StorageError(f"{_SOURCE}: {self.target}.purge_tenant() must return a count "
                               f">= 0, got {value!r}")
        return value

    def stats(self) -> StorageStats:
        if not self._has_stats:
            return super().stats()
        value = self.inner.stats()
        if not isinstance(value, StorageStats):
            raise StorageError(
                f"{_SOURCE}: {self.target}.stats() must return a StorageStats, "
                f"got {type(value).__name__}"
            )
        return value.snapshot()

    # ------------------------------------------------------------ internals
    def _ready(self, keys: Sequence[bytes], host_pages: PageIds | None = None) -> None:
        if self._closed:
            raise StorageError(f"{_SOURCE} ({self.target}) used after close()")
        if self._host is None:
            raise StorageError(f"{_SOURCE} ({self.target}) used before attach()")
        self._check_args(keys, host_pages)

    def _clamp(self, answer: object, keys: Sequence[bytes], what: str) -> int:
        """The answer as a prefix count; a non-integer answer is the class's bug."""
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise StorageError(
                f"{_SOURCE}: {self.target}.{what}() must return an int (a prefix count), "
                f"got {answer!r}"
            )
        return max(0, min(answer, len(keys)))


def _required_string(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise StorageError(
            f"{_SOURCE}: extra config needs {key!r} (a string), got {value!r}; "
            "give module_path (a module name or a .py file) and class_name"
        )
    return value.strip()


def load_class(module_path: str, class_name: str) -> type:
    """Import ``module_path`` (a module name or a .py file) and return its class ``class_name``."""
    module = _import(module_path)
    value = getattr(module, class_name, None)
    if value is None:
        classes = sorted(
            name for name, item in vars(module).items()
            if inspect.isclass(item) and item.__module__ == module.__name__
        )
        raise StorageError(
            f"{_SOURCE}: module {module_path!r} has no {class_name!r}; "
            f"classes defined there: {', '.join(classes) or 'none'}"
        )
    if not inspect.isclass(value):
        raise StorageError(
            f"{_SOURCE}: {module_path}:{class_name} is a {type(value).__name__}, not a class"
        )
    return value


def _import(module_path: str) -> ModuleType:
    is_file = module_path.endswith(".py") or "/" in module_path or "\\" in module_path
    try:
        if not is_file:
            return importlib.import_module(module_path)
        return _import_file(Path(module_path).expanduser())
    except StorageError:
        raise
    except ModuleNotFoundError as error:
        if error.name is not None and (
            module_path == error.name or module_path.startswith(error.name + ".")
        ):
            raise StorageError(
                f"{_SOURCE}: no module {module_path!r} (is it on the server's PYTHONPATH? "
                "module_path may also be the path of a .py file)"
            ) from error
        raise StorageError(
            f"{_SOURCE}: importing {module_path!r} failed: {error}"
        ) from error
    except Exception as error:  # the module's own code failed
        raise StorageError(
            f"{_SOURCE}: importing {module_path!r} failed: {type(error).__name__}: {error}"
        ) from error


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise StorageError(f"{_SOURCE}: module_path {str(path)!r} is not a file")
    resolved = path.resolve()
    # One module per file, named after its path so two files called store.py stay apart.
    name = f"_hicache_dynamic_{resolved.stem}_{zlib.crc32(str(resolved).encode()):08x}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise StorageError(f"{_SOURCE}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look themselves up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def check_class(backend_class: type, target: str) -> None:
    """Raise StorageError unless ``backend_class`` has the backend methods (before construction)."""
    if issubclass(backend_class, StorageBackend):
        abstract = sorted(getattr(backend_class, "__abstractmethods__", ()))
        if abstract:
            raise StorageError(
                f"{_SOURCE}: {target} subclasses StorageBackend but does not implement "
                f"{', '.join(abstract)}"
            )
        return
    missing = [name for name in REQUIRED_METHODS if not hasattr(backend_class, name)]
    if missing:
        raise StorageError(
            f"{_SOURCE}: {target} is not a StorageBackend subclass and lacks "
            f"{', '.join(missing)}; an L3 store class needs "
            f"{', '.join(_signature_text(n, a) for n, a in REQUIRED_METHODS.items())}"
        )
    for name in (*REQUIRED_METHODS, *OPTIONAL_METHODS):
        if hasattr(backend_class, name) and not callable(getattr(backend_class, name)):
            raise StorageError(f"{_SOURCE}: {target}.{name} is not a method")


def check_instance(instance: object, target: str) -> None:
    """Raise StorageError unless each method of ``instance`` accepts the contract's arguments."""
    for name, args in (*REQUIRED_METHODS.items(), *OPTIONAL_METHODS.items()):
        method = getattr(instance, name, None)
        if method is None:
            continue
        if not callable(method):
            raise StorageError(f"{_SOURCE}: {target}.{name} is not a method")
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: judged by its calls
        try:
            signature.bind(*args)
        except TypeError:
            raise StorageError(
                f"{_SOURCE}: {target}.{name}{signature} cannot be called as "
                f"{_signature_text(name, args)}"
            ) from None


def _signature_text(name: str, args: tuple[str, ...]) -> str:
    return f"{name}({', '.join(args)})"
