"""The nixl backend's settings, read from its extra config and checked up front.

The keys are documented in ``hicache.storage.backends.nixl.backend``. Nothing here needs NIXL
installed: a bad configuration is reported before any plugin is loaded.
"""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass

from hicache.local_cache import local_cache_dir
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.options import (
    SETTINGS,
    Directory,
    Flag,
    TextOrDefault,
    must,
    number,
    text_or_default,
)

# O_DIRECT's alignment: the largest logical block size in common use, and the memory page.
DIRECT_ALIGN_BYTES = 4096
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# Plugins whose descriptors are files (FILE_SEG): the ones the backend drives.
FILE_PLUGINS = ("POSIX", "GDS", "GDS_MT")
OBJECT_PLUGIN = "OBJ"
O_DIRECT = getattr(os, "O_DIRECT", 0)


class IoQueue(str, Enum):
    """The POSIX plugin's kernel queue (its ``use_*`` init parameters)."""

    AUTO = "auto"  # the plugin's choice (Linux AIO where it works)
    AIO = "aio"  # Linux native AIO (io_submit)
    URING = "uring"  # io_uring
    POSIX_AIO = "posix_aio"  # glibc's POSIX AIO (a thread pool)

    @property
    def init_params(self) -> dict[str, str]:
        return {} if self is IoQueue.AUTO else {f"use_{self.value}": "true"}


def default_path() -> Path:
    return local_cache_dir() / "l3-nixl"


def _plugin(given: str) -> str:
    plugin = given.upper()
    if plugin == OBJECT_PLUGIN:
        raise ValueError(
            "'OBJ' stores S3 objects through object descriptors, which this backend does "
            "not build; use POSIX (or GDS on a GPU machine)"
        )
    if plugin not in FILE_PLUGINS:
        raise ValueError(f"must be one of {', '.join(FILE_PLUGINS)}, got {given!r}")
    return plugin


def _io_queue(value: object) -> IoQueue:
    given = text_or_default(value)
    try:
        return IoQueue(given.lower())
    except ValueError:
        choices = ", ".join(q.value for q in IoQueue)
        raise ValueError(f"must be one of {choices}, got {given!r}") from None


@dataclass(frozen=True, config=SETTINGS)
class NixlSettings:
    """Where the page files live and how NIXL moves them."""

    path: Directory = Field(default_factory=default_path)
    plugin: Annotated[TextOrDefault, AfterValidator(_plugin)] = "POSIX"
    io_queue: Annotated[IoQueue, BeforeValidator(_io_queue)] = IoQueue.AUTO
    direct_io: Annotated[
        Flag, must(lambda on: O_DIRECT or not on, "needs O_DIRECT, which this OS lacks")
    ] = False
    verify_checksum: Flag = True
    transfer_timeout_s: Annotated[float, number(0.001)] = DEFAULT_TRANSFER_TIMEOUT_S

    @model_validator(mode="after")
    def _queue_needs_posix(self) -> NixlSettings:
        if self.io_queue is not IoQueue.AUTO and self.plugin != "POSIX":
            raise ValueError("io_queue applies to the POSIX plugin only")
        return self

    @property
    def plugin_params(self) -> dict[str, str]:
        """The plugin's init parameters (the queue, for POSIX)."""
        return self.io_queue.init_params if self.plugin == "POSIX" else {}

    @property
    def trailer_bytes(self) -> int:
        """Bytes after the payload in a page file: the header, padded to a block for O_DIRECT."""
        return DIRECT_ALIGN_BYTES if self.direct_io else HEADER_BYTES

    @property
    def open_flags(self) -> int:
        """Flags every page file is opened with, besides its access mode."""
        return getattr(os, "O_CLOEXEC", 0) | (O_DIRECT if self.direct_io else 0)
