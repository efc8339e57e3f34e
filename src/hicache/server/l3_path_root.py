"""``--l3-path-root``: the directory the admin API may put an L3 store's files under.

The backends that keep files (``file``, ``nixl``, ``aibrix``'s RocksDB) take a
``path`` in their extra config; they create directories there, write pages and,
on ``/clear_hicache_storage_backend``, remove page files. Through the admin API
that path comes from a request, so it is confined: it must resolve inside the
root (``..`` and symlinks resolved, as the kernel would follow them at the time
of the request) or the attach is a 403 and nothing is created. A relative path
is taken relative to the root (``{"path": "l3-b"}`` is ``<root>/l3-b``); ``~``
is the server user's home, as at start-up. The backend is then handed the
resolved absolute path, so what was checked is what is used.

The root defaults to the local cache dir (``$HICACHE_CACHE_DIR``, else
``~/.cache/hicache``), where the default stores already live. A path given in
``--hicache-storage-backend-extra-config`` at start-up is the operator's and is
not confined; neither is a backend's default path (no request chose it). The path of a
backend wrapped by another (``throttled``'s ``backend_extra``) is confined the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.local_cache import local_cache_dir
from hicache.server.errors import APIError
from hicache.storage.registry import WRAPPER_KEYS, wrapped_backend

FLAG = "--l3-path-root"
# Backend name -> the extra-config key naming the directory it writes (and clears).
PATH_KEYS: dict[str, str] = {"file": "path", "nixl": "path", "aibrix": "path"}


def resolve_root(root: str | Path | None = None) -> Path:
    """The root as checked against: absolute, symlinks resolved; the local cache dir by
    default."""
    return Path(root if root is not None else local_cache_dir()).expanduser().resolve()


def confined_extra_config(
    backend: str, extra_config: Mapping[str, Any], root: Path, param: str = "extra_config"
) -> dict[str, Any]:
    """``extra_config`` with the backend's path resolved inside ``root``, and so the path
    of any backend it wraps (``storage.registry.wrapped_backend``); APIError(403) for a
    path outside it, APIError(400) for a path that is not text. ``param`` names
    ``extra_config`` in errors."""
    config = dict(extra_config)
    wrapped = wrapped_backend(backend, config)
    if wrapped is not None:
        inner_key = WRAPPER_KEYS[backend.strip().lower()][1]
        config[inner_key] = confined_extra_config(
            wrapped[0], wrapped[1], root, f"{param}.{inner_key}"
        )
    key = PATH_KEYS.get(backend.strip().lower())
    if key is None or config.get(key) is None:
        return config
    given = config[key]
    if not isinstance(given, str) or not given.strip():
        raise APIError(400, f"{param}.{key} must be a directory path", param=f"{param}.{key}")
    resolved = (root / Path(given).expanduser()).resolve()
    if not resolved.is_relative_to(root):
        raise APIError(
            403, f"{param}.{key} {given!r} resolves to {resolved}, outside {root}: the "
            f"admin API puts L3 files only under the server's {FLAG}",
            param=f"{param}.{key}",
        )
    config[key] = str(resolved)
    return config
