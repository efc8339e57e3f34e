"""A page file mapped into memory, for opening a sealed page straight from the page cache.

A plain page is read with ``readv``: the kernel's copy into the host page is the one
pass it needs. A sealed page needs a decryption pass as well, and AES-GCM can do the
copy's work itself: mapping the file and decrypting from the mapping into the host
page moves every byte once instead of twice (a copy, then a decryption in place),
which on one core is most of the difference between the two paths.

Invariants:
- The mapping is read-only and private to the call (``mapped`` unmaps it, and
  releases the view it lent, before it returns).
- Every page of the mapping is faulted in up front with ``MADV_POPULATE_READ``, so an
  I/O error reading the file is an ``OSError`` there (the page is a miss), not a
  ``SIGBUS`` in the middle of the decryption. Where the kernel has no such advice
  (before Linux 5.14), or where the file system cannot map files, ``mapped`` yields
  None and the caller reads the file instead.
- Page files are never changed in place (a writer renames a whole new file over the
  name), so the mapping holds the bytes the file had when it was opened. A program
  that truncates a page file in place while it is read breaks that, as it would
  for any reader of a mapped file.
"""

from __future__ import annotations

import errno
import mmap
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Linux's MADV_POPULATE_READ (5.14+); Python names it only from 3.13 on.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)
_supported = _POPULATE_READ is not None
# What mmap answers for a file it cannot map at all (not an I/O error).
_CANNOT_MAP = frozenset(
    code for code in (
        errno.ENODEV, errno.EINVAL, errno.EACCES, getattr(errno, "ENOTSUP", None),
        getattr(errno, "EOPNOTSUPP", None),
    ) if code is not None
)


@contextmanager
def mapped(fd: int, size: int) -> Iterator[memoryview | None]:
    """The ``size`` bytes of open file ``fd``, mapped and faulted in; None where the
    kernel cannot fault a mapping in without the risk of a SIGBUS (read it instead).
    Raises ``OSError`` when the file cannot be mapped or read."""
    global _supported
    if not _supported or size <= 0:
        yield None
        return
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as error:
        if error.errno not in _CANNOT_MAP:
            raise
        yield None  # a file system without mappings (some network or FUSE ones): read
        return
    with mapping:
        try:
            mapping.madvise(_POPULATE_READ)  # type: ignore[arg-type]
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            _supported = False  # an older kernel: it will not know it next time either
            yield None
            return
        view = memoryview(mapping)
        try:
            yield view
        finally:
            view.release()
