"""The nixl backend's settings, read from its extra config and checked up front.

The keys are documented in ``hicache.storage.backends.nixl.backend``. Nothing here needs NIXL
installed: a bad configuration is reported before any plugin is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hicache.local_cache import local_cache_dir
from hicache.storage.base import StorageError
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.options import Options

# O_DIRECT's alignment: the largest logical block size in common use, and the memory page.
DIRECT_ALIGN_BYTES = 4096
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# Plugins whose descriptors are files (FILE_SEG): the ones the backend drives.
FILE_PLUGINS = ("POSIX", "GDS", "GDS_MT")
OBJECT_PLUGIN = "OBJ"
KNOWN_KEYS = frozenset(
    {"path", "plugin", "io_queue", "direct_io", "verify_checksum", "transfer_timeout_s"}
)
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


@dataclass(frozen=True)
class NixlSettings:
    """Where the page files live and how NIXL moves them."""

    path: Path
    plugin: str = "POSIX"
    io_queue: IoQueue = IoQueue.AUTO
    direct_io: bool = False
    verify_checksum: bool = True
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    @classmethod
    def from_options(cls, options: Options) -> NixlSettings:
        source = options.source
        options.reject_unknown(KNOWN_KEYS)
        path = options.string("path", None)
        plugin = (options.string("plugin", "POSIX") or "POSIX").upper()
        if plugin == OBJECT_PLUGIN:
            raise StorageError(
                f"{source}: plugin 'OBJ' stores S3 objects through object descriptors, "
                "which this backend does not build; use POSIX (or GDS on a GPU machine)"
            )
        if plugin not in FILE_PLUGINS:
            raise StorageError(
                f"{source}: plugin must be one of {', '.join(FILE_PLUGINS)}, "
                f"got {options.extra['plugin']!r}"
            )
        queue = options.string("io_queue", IoQueue.AUTO.value) or IoQueue.AUTO.value
        try:
            io_queue = IoQueue(queue.lower())
        except ValueError:
            choices = ", ".join(q.value for q in IoQueue)
            raise StorageError(
                f"{source}: io_queue must be one of {choices}, got {queue!r}"
            ) from None
        if io_queue is not IoQueue.AUTO and plugin != "POSIX":
            raise StorageError(f"{source}: io_queue applies to the POSIX plugin only")
        direct_io = options.boolean("direct_io", False)
        if direct_io and not O_DIRECT:
            raise StorageError(f"{source}: direct_io needs O_DIRECT, which this OS lacks")
        return cls(
            path=Path(path).expanduser() if path else default_path(),
            plugin=plugin, io_queue=io_queue, direct_io=direct_io,
            verify_checksum=options.boolean("verify_checksum", True),
            transfer_timeout_s=options.number(
                "transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S, minimum=0.001
            ),
        )

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
