"""The page bytes of one store directory, kept by every instance sharing it.

Why: each instance knows the pages it wrote, read or found at start-up. When each
capped only those, a directory shared by N instances grew to N caps (a router that
keeps conversations on one worker keeps the instances' indexes disjoint). The ledger
lets every instance see what the directory holds, so that the cap is the directory's.

``<root>/ledger`` holds two little-endian 64-bit counts:
- ``total``: bytes of the page files in the directory: a write adds its file's bytes
  once it is renamed into place, a removal that did remove a file subtracts them;
- ``written``: bytes ever written there by any instance (only grows). An instance
  compares it with what it wrote itself to tell when others have written enough
  that its index (and LRU order) is stale (``FileBackend._evict_locked``).

Each update is a read-modify-write under an exclusive ``flock`` of the ledger file:
each instance opens the file itself, and a lock belongs to an open file description,
so instances (processes or not) exclude each other; threads of one instance are
serialised by a lock here. The rename or removal an update accounts for happens under
the same lock (``change``), and ``resync`` scans the directory under it, so a scan
never falls between a change and its account (it would lose or double it).

``total`` is an estimate kept honest by scans, not an invariant: an instance that
dies between its rename and its update leaves it short, and files removed by hand
are still counted. ``resync`` sets it to what a scan of the directory found. A
ledger that cannot be read (missing, short, or an I/O error) reads as None: the
caller then scans.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

LEDGER_FILE = "ledger"
_FORMAT = struct.Struct("<QQ")


@dataclass(frozen=True)
class LedgerCounts:
    """The directory's page bytes now, and the bytes ever written to it."""

    total: int
    written: int


class DirectoryLedger:
    """See the module docstring. Thread safe."""

    def __init__(self, root: Path) -> None:
        self.path = root / LEDGER_FILE
        self._fd: int | None = None
        self._lock = threading.RLock()
        self._depth = 0  # nesting of ``_locked`` in the thread holding ``_lock``

    def open(self) -> None:
        """Open (creating when missing) the ledger file. Raises ``OSError``."""
        # Not through a link: the ledger is written in place, unlike pages.
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, flags, 0o644)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def read(self) -> LedgerCounts | None:
        """The counts, or None when they cannot be read (the caller scans)."""
        with self._locked() as fd:
            return None if fd is None else _read(fd)

    @contextlib.contextmanager
    def change(self) -> Iterator[Callable[[int, int], None]]:
        """Hold the ledger while the directory changes: yields ``account(delta, written)``,
        which adds ``delta`` to the total (a removal: negative) and ``written`` to the
        written count (nothing when the ledger cannot be read: the next scan sets it).
        The file's rename or removal goes inside the block, so that a ``resync``'s scan
        sees the directory either before the change and its account, or after both."""
        with self._locked() as fd:

            def account(delta: int, written: int = 0) -> None:
                if fd is None or (delta == 0 and written == 0):
                    return
                counts = _read(fd)
                if counts is not None:
                    _write(fd, LedgerCounts(max(0, counts.total + delta),
                                            counts.written + written))

            yield account

    def resync(self, scan: Callable[[], int]) -> LedgerCounts | None:
        """Set the total to what ``scan`` (run under the lock: no writer's update is lost
        meanwhile) finds; the counts after, or None when the ledger cannot be written."""
        with self._locked() as fd:
            total = scan()
            if fd is None:
                return None
            counts = _read(fd)
            written = 0 if counts is None else counts.written
            updated = LedgerCounts(total, written)
            return updated if _write(fd, updated) else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int | None]:
        """The file, locked against other instances (None when it is closed or the lock
        failed); reentrant within a thread, so a scan under ``resync`` may update it."""
        with self._lock:
            fd = self._fd
            if fd is None:
                yield None
                return
            if self._depth:
                self._depth += 1
                try:
                    yield fd
                finally:
                    self._depth -= 1
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                yield None
                return
            self._depth = 1
            try:
                yield fd
            finally:
                self._depth = 0
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)


def _read(fd: int) -> LedgerCounts | None:
    try:
        data = os.pread(fd, _FORMAT.size, 0)
    except OSError:
        return None
    if len(data) == 0:
        return LedgerCounts(0, 0)  # just created: the attach's resync sets it
    if len(data) != _FORMAT.size:
        return None
    total, written = _FORMAT.unpack(data)
    return LedgerCounts(total, written)


def _write(fd: int, counts: LedgerCounts) -> bool:
    try:
        return os.pwrite(fd, _FORMAT.pack(counts.total, counts.written), 0) == _FORMAT.size
    except OSError:
        return False
