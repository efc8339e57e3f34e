"""Backends by name, imported lazily so that an optional dependency is only needed when used.

``create_storage_backend("mooncake", extra)`` imports ``hicache.storage.backends.mooncake.backend``
only then; if its client library is missing the error says how to install it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.storage.base import StorageBackend, StorageError


@dataclass(frozen=True)
class BackendEntry:
    module: str
    class_name: str
    summary: str
    # What to install when the module's third-party import fails: {missing module: hint}.
    install_hints: Mapping[str, str]


MOONCAKE_INSTALL_HINT = (
    "pip install 'hicache[mooncake]' (that is mooncake-transfer-engine-non-cuda, for CPU "
    "machines; with CUDA install mooncake-transfer-engine instead), and the system "
    "libraries it links against: on Debian/Ubuntu apt-get install libibverbs1 librdmacm1 libnuma1"
)

AIBRIX_INSTALL_HINT = (
    "pip install 'hicache[aibrix]' (its dependencies), then pip install --no-deps "
    "aibrix-kvcache==0.8.0 (its own requirements would pull redis==6.0.0, netifaces and "
    "profilers that we do not use); scripts/bootstrap.sh does both"
)
# Modules whose absence means the aibrix extra is not installed (AIBrix's and RocksDB's).
_AIBRIX_MODULES = (
    "aibrix_kvcache", "rocksdict", "farmhash", "uvloop", "zstandard", "more_itertools",
    "sortedcontainers", "redis",
)
NIXL_INSTALL_HINT = (
    "pip install 'hicache[nixl]' (that is nixl-cu12; to use the nixl meta package as "
    "well, which picks the wheel of your CUDA version, add it without its dependencies: "
    "pip install --no-deps nixl==1.5.1)"
)
REDIS_INSTALL_HINT = (
    "pip install 'hicache[redis]' (the redis-py client); the server is redis-server "
    "(apt-get install redis-server) or valkey-server, anywhere the url reaches"
)

BACKENDS: dict[str, BackendEntry] = {
    "file": BackendEntry(
        "hicache.storage.backends.file.backend", "FileBackend",
        "one file per page in a local directory", {},
    ),
    "mooncake": BackendEntry(
        "hicache.storage.backends.mooncake.backend", "MooncakeBackend",
        "Mooncake Store (distributed memory pool)",
        {"mooncake": MOONCAKE_INSTALL_HINT},
    ),
    "aibrix": BackendEntry(
        "hicache.storage.backends.aibrix.backend", "AibrixBackend",
        "AIBrix KVCache (its host L1 cache over a RocksDB L2 in a local directory)",
        dict.fromkeys(_AIBRIX_MODULES, AIBRIX_INSTALL_HINT),
    ),
    "nixl": BackendEntry(
        "hicache.storage.backends.nixl.backend", "NixlBackend",
        "page files moved by NVIDIA NIXL's POSIX (or GDS) storage plugin",
        {"nixl": NIXL_INSTALL_HINT, "nixl_cu12": NIXL_INSTALL_HINT},
    ),
    "redis": BackendEntry(
        "hicache.storage.backends.redis.backend", "RedisBackend",
        "a Redis or Valkey server (pages in its memory)",
        {"redis": REDIS_INSTALL_HINT},
    ),
    "lmcache": BackendEntry(
        "hicache.storage.backends.lmcache.backend", "LMCacheBackend",
        "an LMCache server (lmcache_server) over TCP, spoken to by our own client", {},
    ),
    "throttled": BackendEntry(
        "hicache.storage.backends.throttled.backend", "ThrottledBackend",
        "another backend behind a simulated latency and bandwidth (for tests and benchmarks)",
        {},
    ),
    "dynamic": BackendEntry(
        "hicache.storage.backends.dynamic.backend", "DynamicBackend",
        "your own class: extra config module_path + class_name", {},
    ),
}


# Backends that seal pages under --l3-encryption-keys (``StorageBackend.supports_sealing``;
# known here without importing them, so that start-up refuses the others at once).
SEALING_BACKENDS = frozenset({"file", "redis", "mooncake"})

# Backends that wrap another one: their extra-config keys naming it and holding its own
# extra config. What is checked of a backend by name (the admin API's refusal of code
# loading, its confinement of paths) is checked of the backends it wraps too.
WRAPPER_KEYS: dict[str, tuple[str, str]] = {"throttled": ("backend", "backend_extra")}


def wrapped_backend(
    name: str, extra_config: Mapping[str, Any]
) -> tuple[str, Mapping[str, Any]] | None:
    """The backend ``name`` wraps and its extra config, as ``extra_config`` gives them
    (name normalised); None for a backend that wraps none, or a config that does not name
    one properly (its settings then refuse it)."""
    keys = WRAPPER_KEYS.get(name.strip().lower())
    if keys is None:
        return None
    inner, inner_extra = extra_config.get(keys[0]), extra_config.get(keys[1]) or {}
    if not isinstance(inner, str) or not isinstance(inner_extra, Mapping):
        return None
    return inner.strip().lower(), inner_extra


def backend_names(name: str, extra_config: Mapping[str, Any]) -> list[str]:
    """``name`` (normalised) and every backend it wraps, outermost first."""
    names = [name.strip().lower()]
    wrapped = wrapped_backend(name, extra_config)
    while wrapped is not None:  # each step goes one object deeper into the config
        names.append(wrapped[0])
        wrapped = wrapped_backend(*wrapped)
    return names


def create_storage_backend(name: str, extra_config: Mapping[str, Any] | None) -> StorageBackend:
    """A new, unattached backend called ``name``, configured by ``extra_config``.

    Raises StorageError for an unknown name, a backend whose dependencies are
    missing (with an install hint) or a bad configuration.
    """
    entry = BACKENDS.get(name)
    if entry is None:
        choices = ", ".join(sorted(BACKENDS))
        raise StorageError(f"unknown L3 storage backend {name!r}; choose one of: {choices}")
    try:
        module = importlib.import_module(entry.module)
    except ImportError as error:
        raise StorageError(_import_failure(name, entry, error)) from error
    backend_class = getattr(module, entry.class_name)
    backend: StorageBackend = backend_class(extra_config or {})
    return backend


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot be created here (a missing dependency), or None."""
    entry = BACKENDS.get(name)
    if entry is None:
        return f"unknown L3 storage backend {name!r}"
    try:
        importlib.import_module(entry.module)
    except ImportError as error:
        return _import_failure(name, entry, error)
    return None


def _import_failure(name: str, entry: BackendEntry, error: ImportError) -> str:
    missing = error.name or ""
    for module, hint in entry.install_hints.items():
        if missing == module or missing.startswith(module + "."):
            return f"L3 storage backend {name!r} needs the {module!r} package: {hint}"
    # A shared library the extension links against (libibverbs.so.1 ...) is missing.
    if ".so" in str(error) and entry.install_hints:
        hints = "; ".join(entry.install_hints.values())
        return f"L3 storage backend {name!r} cannot load its client library ({error}): {hints}"
    return f"L3 storage backend {name!r} cannot be imported: {error}"
