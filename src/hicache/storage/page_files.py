"""Page files on disk, as the file and nixl backends lay them out.

Both keep one file per page at ``<root>/<first two hex digits>/<frame.object_name>``
(the fan-out keeps directories small), write it under a temporary name in the
same directory and rename it into place (atomic, so a reader sees a whole page
or none). The two backends read each other's files, so the names, the
temporaries and when a temporary is stale are defined once, here.

``clear`` removes a page file only when it holds a page as we write it: a
regular file whose trailer starts with our ``frame`` header for the key and row
order its name says (``holds_our_page``). A file that merely has a page-shaped
name (something else's, in a directory the store was pointed at) is left alone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import zlib
from stat import S_ISREG

from hicache.storage.frame import (
    HEADER_BYTES,
    SEALED_HEADER_BYTES,
    PayloadOrder,
    check_header,
)

# A temporary file whose writer is still running is only stale past this age (a
# page write takes milliseconds; this only guards against a recycled pid).
STALE_TEMP_AGE_S = 300.0
TEMP_SUFFIX = ".tmp"
_NAME_TAILS = tuple(f".{order.tag}" for order in PayloadOrder)
_NAME_CHARS = 32 + 3  # hex key + ".lm" / ".tm"
# Bytes after the payload in a page file: the header alone (file, buffered nixl) or the
# header padded to a 4096-byte block (nixl with O_DIRECT), or a sealed page's header
# (``storage.sealing``), each with whether it is sealed.
TRAILER_SIZES = ((HEADER_BYTES, False), (4096, False), (SEALED_HEADER_BYTES, True))
# Names the writing machine in temporaries: a process id means nothing on another host
# sharing the directory (over NFS, say), so there only age makes a temporary stale.
_HOST_TAG = format(zlib.crc32(socket.gethostname().encode()), "08x")


def page_path(root: str, name: str) -> str:
    """Where page file ``name`` (a ``frame.object_name``) lives under directory ``root``."""
    return f"{root}/{name[:2]}/{name}"


def is_page_name(name: str) -> bool:
    """``frame.object_name``'s shape: 32 hex digits, a dot and a payload-order tag."""
    if len(name) != _NAME_CHARS or not name.endswith(_NAME_TAILS):
        return False
    try:
        bytes.fromhex(name[:32])
    except ValueError:
        return False
    return True


def holds_our_page(path: str, name: str) -> bool:
    """Is ``path`` (page file ``name``) a page as these backends write it: a regular file
    (not a link) whose trailer starts with our header, naming the key and row order of
    ``name``, for a payload that fills the rest of the file? Unreadable: no."""
    if not is_page_name(name):
        return False
    key = bytes.fromhex(name[:32])
    order = PayloadOrder.of_tag(name[33:])
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False  # gone, a symlink (O_NOFOLLOW), or not ours to read
    try:
        info = os.fstat(fd)
        size = info.st_size if S_ISREG(info.st_mode) else -1
        for trailer, sealed in TRAILER_SIZES:
            payload = size - trailer
            if payload >= 0 and check_header(
                os.pread(fd, trailer if sealed else HEADER_BYTES, payload), key, order,
                payload, sealed,
            ) is None:
                return True
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def temp_name(name: str, pid: int, thread: int, host_tag: str = _HOST_TAG) -> str:
    """The temporary a writer (process ``pid``, thread ``thread``) fills before the rename."""
    return f".{name}.{host_tag}-{pid}-{thread}{TEMP_SUFFIX}"


def is_stale_temp(name: str, age_s: float) -> bool:
    """A temporary is stale when its writer process is gone (or it is very old)."""
    if age_s > STALE_TEMP_AGE_S:
        return True
    try:
        host, pid_text, _ = name.rsplit(".", 2)[-2].split("-")
        pid = int(pid_text)
    except ValueError:
        return True  # not a name we write: left by something else, and unusable
    if host != _HOST_TAG:
        return False  # another machine's writer: we cannot tell whether it still runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by another user
    return False


def create_file(path: str, extra_flags: int) -> int:
    """Open ``path`` for writing, created empty (the fan-out directory too, on first use)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra_flags
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o644)


def unlink_quietly(path: str) -> None:
    """Remove a file, best effort: one already gone, or that cannot be removed, is not ours
    to manage (a page left behind is only found bad, or missing, again)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
