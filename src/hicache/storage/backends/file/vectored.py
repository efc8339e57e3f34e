"""Whole-buffer ``readv``/``writev``: a page file moves between the disk and the host
page's own memory as one scatter/gather list, whatever a call moves short."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

try:
    _IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


def read_all(fd: int, buffers: Sequence[memoryview]) -> int:
    """Fill ``buffers`` from ``fd`` in order; returns the bytes read (less only at EOF)."""
    total = 0
    pending = [b.cast("B") for b in buffers]
    while pending:
        got = os.readv(fd, pending[:_IOV_MAX])
        if got == 0:
            break
        total += got
        pending = advance(pending, got)
    return total


def write_all(fd: int, buffers: Sequence[Any]) -> None:
    """Write every byte of ``buffers`` (anything with the buffer protocol) to ``fd``."""
    pending = [memoryview(b).cast("B") for b in buffers]
    while pending:
        wrote = os.writev(fd, pending[:_IOV_MAX])
        pending = advance(pending, wrote)


def advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` bytes of a buffer list (after a short readv/writev)."""
    index = 0
    while index < len(buffers) and nbytes >= len(buffers[index]):
        nbytes -= len(buffers[index])
        index += 1
    rest = buffers[index:]
    if rest and nbytes:
        rest[0] = rest[0][nbytes:]
    return rest
