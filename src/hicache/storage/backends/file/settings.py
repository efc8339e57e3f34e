"""The file backend's settings: its extra config keys (see ``backend.py``) and its defaults.

Imports no torch, so a router that asks a shared file L3 for pages finds the default
directory without loading the engine's dependencies.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic.dataclasses import dataclass

from hicache.local_cache import local_cache_dir
from hicache.storage.options import SETTINGS, Directory, Flag, Size

DEFAULT_MAX_BYTES = 16 * 10**9


def default_path() -> Path:
    return local_cache_dir() / "l3"


@dataclass(frozen=True, config=SETTINGS)
class FileSettings:
    """The file backend's extra config (see the module docstring)."""

    path: Directory = Field(default_factory=default_path)
    max_bytes: Size = DEFAULT_MAX_BYTES
    fsync: Flag = False
    verify_checksum: Flag = True
