"""Pins of the file store: one marker file per pinned page, shared by every instance.

A pinned page is never evicted by the size cap nor by the ENOSPC path until its
pin expires or is removed. The pin lives on disk, next to the pages, so every
instance sharing the directory honours it and it survives restarts:

    ``<root>/pins/<first two hex digits>/<page object name>``

An empty file whose modification time is the pin's expiry (wall clock): a
single ``stat`` tells whether a page is pinned and until when. A marker is
written to a temporary name and renamed into place, so a reader never sees a
marker whose time is not yet set. Pinning a page already pinned keeps the later
expiry (two instances pinning one page never shorten each other's pin); unpin
removes the marker whoever wrote it. A marker may name a page not (yet) stored:
the page is pinned from the moment it is written.

Expired markers are removed lazily (when met, and at attach), only once they
have been expired for ``EXPIRED_GRACE_S``: a marker re-pinned by another
instance between our ``stat`` and our ``unlink`` would otherwise be lost.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from pathlib import Path

from hicache.storage.base import StorageError
from hicache.storage.page_files import TEMP_SUFFIX, unlink_quietly

PINS_DIR = "pins"
# How long an expired marker is left before it is removed (see the module docstring).
EXPIRED_GRACE_S = 60.0


def check_expiry(until_unix_s: object) -> float:
    """A pin's expiry as given to ``pin``: a finite, positive number of unix seconds."""
    if isinstance(until_unix_s, bool) or not isinstance(until_unix_s, int | float):
        raise StorageError(f"a pin's expiry is unix seconds, got {until_unix_s!r}")
    value = float(until_unix_s)
    if not math.isfinite(value) or value <= 0:
        raise StorageError(f"a pin's expiry must be finite and positive, got {until_unix_s!r}")
    return value


class PinMarkers:
    """The pin markers under one store directory (module docstring). Thread safe: every
    call is a few file system calls on its own marker."""

    def __init__(self, root: Path) -> None:
        self.root = root / PINS_DIR
        self._root_text = str(self.root)

    def _path(self, name: str) -> str:
        return f"{self._root_text}/{name[:2]}/{name}"

    def expiry(self, name: str, now: float | None = None) -> float | None:
        """Until when page ``name`` is pinned (unix seconds), or None when it is not (no
        marker, or an expired one: removed once past the grace)."""
        path = self._path(name)
        try:
            until = os.stat(path).st_mtime
        except OSError:
            return None
        now = time.time() if now is None else now
        if until > now:
            return until
        if until + EXPIRED_GRACE_S <= now:
            unlink_quietly(path)
        return None

    def pin(self, name: str, until_unix_s: float) -> None:
        """Pin page ``name`` until ``until_unix_s`` (or later, if already pinned longer).
        Raises OSError when the marker cannot be written."""
        current = self.expiry(name)
        if current is not None and current >= until_unix_s:
            return
        directory = f"{self._root_text}/{name[:2]}"
        os.makedirs(directory, exist_ok=True)
        temp = f"{directory}/.{name}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb"):
                pass
            stamp = int(until_unix_s * 1e9)
            os.utime(temp, ns=(stamp, stamp))
            os.replace(temp, self._path(name))
        except OSError:
            unlink_quietly(temp)
            raise

    def unpin(self, name: str) -> bool:
        """Remove page ``name``'s pin; False when it had none."""
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return False
        return True

    def sweep(self, now: float | None = None) -> int:
        """Remove markers expired past the grace, and temporaries of dead writers (old
        ones); returns how many live pins remain."""
        now = time.time() if now is None else now
        live = 0
        if not self.root.is_dir():
            return 0
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            with os.scandir(sub) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        mtime = entry.stat(follow_symlinks=False).st_mtime
                        if entry.name.endswith(TEMP_SUFFIX):
                            # A temporary's time is the expiry it was about to get, or
                            # its creation: only one from a writer long gone is removed.
                            if entry.name.startswith(".") and mtime + EXPIRED_GRACE_S <= now:
                                unlink_quietly(entry.path)
                        elif mtime > now:
                            live += 1
                        elif mtime + EXPIRED_GRACE_S <= now:
                            unlink_quietly(entry.path)
        return live
