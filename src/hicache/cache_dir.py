"""The local cache directory: converted models and the file L3 tier live under it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "HICACHE_CACHE_DIR"


def cache_dir() -> Path:
    """``$HICACHE_CACHE_DIR``, else ``~/.cache/hicache`` (read on every call: tests move it)."""
    base = os.environ.get(CACHE_DIR_ENV)
    return Path(base).expanduser() if base else Path.home() / ".cache" / "hicache"
