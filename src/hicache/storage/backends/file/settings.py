"""The file backend's settings: its extra config keys (see ``backend.py``) and its defaults.

Imports no torch, so a router that asks a shared file L3 for pages finds the default
directory without loading the engine's dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field
from pydantic.dataclasses import dataclass

from hicache.local_cache import local_cache_dir
from hicache.storage.options import (
    SETTINGS,
    Directory,
    Flag,
    FlagOrAuto,
    Size,
    must,
    number,
)

DEFAULT_MAX_BYTES = 16 * 10**9
# The free space the store leaves on its file system when ``min_free_bytes`` is not set: a
# share of the file system's size, within bounds. A cache must not take a disk's last
# bytes from the programs that share it (a log, a package install, a database).
DEFAULT_MIN_FREE_SHARE = 0.05
DEFAULT_MIN_FREE_FLOOR = 2**30
DEFAULT_MIN_FREE_CEILING = 10 * 2**30


def default_path() -> Path:
    return local_cache_dir() / "l3"


@dataclass(frozen=True, config=SETTINGS)
class FileSettings:
    """The file backend's extra config (see the module docstring)."""

    path: Directory = Field(default_factory=default_path)
    max_bytes: Size = DEFAULT_MAX_BYTES
    # None: ``default_min_free``; 0: fill the file system (ENOSPC then evicts).
    min_free_bytes: Size | None = None
    fsync: Flag = False
    # Page payloads written with O_DIRECT where the host pool allows it (``direct_io``);
    # None ("auto"): when the model's forward runs on this machine's CPU.
    direct_writes: FlagOrAuto = None
    # Page payloads read with O_DIRECT (``direct_io``); None ("auto"): where they are
    # written directly.
    direct_reads: FlagOrAuto = None
    verify_checksum: Flag = True
    # The share of ``max_bytes`` in the loop-resistant core set (``eviction_order``);
    # 0: plain least-recently-used eviction.
    core_fraction: Annotated[float, number(), must(lambda share: share < 1.0,
                             "must be below 1 (a share of max_bytes), got {!r}")] = 0.75


def default_min_free(file_system_bytes: int) -> int:
    """The free space to leave on a file system of ``file_system_bytes``: 5% of it, at
    least 1 GiB and at most 10 GiB (never more than a tenth of a small file system)."""
    share = int(file_system_bytes * DEFAULT_MIN_FREE_SHARE)
    floor = min(DEFAULT_MIN_FREE_FLOOR, file_system_bytes // 10)
    return max(floor, min(share, DEFAULT_MIN_FREE_CEILING))
