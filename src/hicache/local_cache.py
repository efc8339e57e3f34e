"""The local cache directory: where hicache keeps what is worth keeping across restarts.

``$HICACHE_CACHE_DIR`` when set, else ``~/.cache/hicache``. The file L3 backend
keeps its pages under ``l3/`` and the model identity its weight digests in
``weight-digests.json``; a test or a benchmark points the variable elsewhere to
keep its files apart.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "HICACHE_CACHE_DIR"


def local_cache_dir() -> Path:
    """The cache directory (not created here: each user makes what it needs)."""
    base = os.environ.get(CACHE_DIR_ENV)
    return Path(base).expanduser() if base else Path.home() / ".cache" / "hicache"
