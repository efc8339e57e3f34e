"""What the cache knows of each host page's payload checksum (the L3 frame's xxh3_128).

An L3 frame carries the xxh3_128 of its page's payload. Hashing a page in a
pass of its own reads it from DRAM once more, and on a machine whose memory
bandwidth the page copies already use, that pass alone costs a third of an L3
put's or get's throughput. So the checksum is taken where the page's bytes
pass through the cache anyway:

- KNOWN: computed while the page was copied into the host pool (the L1 -> L2
  write, ``transfer.digesting``); an L3 put takes it instead of hashing.
- EXPECTED: the page came from L3 and its header's checksum passed every check
  but the payload's, which the L2 -> L1 load verifies while it copies the page
  (``HierarchicalCache``): a page that fails turns the matched prefix back into
  a miss from there on, and its tokens are recomputed.
- UNKNOWN: anything else (written by a path that does not hash); an L3 put
  hashes it.

Writers set the state of the pages they fill before anyone may read them; a
page is never filled by two writers at once (the cache hands each page to one
copy or L3 read), so no lock is needed beyond the GIL's per-element atomicity.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

import numpy as np

from hicache.memory.allocator import PageIds

DIGEST_BYTES = 16


class DigestState(IntEnum):
    UNKNOWN = 0
    KNOWN = 1
    EXPECTED = 2


class PageDigests:
    """Per host page: a payload checksum and whether it was computed here or only claimed."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._state = np.zeros(num_pages, dtype=np.uint8)
        self._digest = np.zeros((num_pages, DIGEST_BYTES), dtype=np.uint8)
        # Whether L3 reads leave the payload check to the L2 -> L1 load (set by the cache
        # when its loads verify EXPECTED pages; otherwise a read verifies at once).
        self.defer_checks = False

    def state(self, page: int) -> DigestState:
        return DigestState(int(self._state[page]))

    def digest(self, page: int) -> bytes | None:
        """The page's checksum, KNOWN or EXPECTED; None when unknown.

        An EXPECTED digest is what the page's bytes must hash to: storing it again
        with that digest keeps any damage detectable by whoever reads it.
        """
        if self._state[page] == DigestState.UNKNOWN:
            return None
        digest: bytes = self._digest[page].tobytes()
        return digest

    def set_known(self, page: int, digest: bytes) -> None:
        self._set(page, digest, DigestState.KNOWN)

    def expect(self, page: int, digest: bytes) -> None:
        self._set(page, digest, DigestState.EXPECTED)

    def forget(self, pages: Iterable[int] | PageIds) -> None:
        self._state[np.asarray(pages, dtype=np.int64)] = DigestState.UNKNOWN

    def expected(self, pages: PageIds) -> np.ndarray:
        """Mask of ``pages`` whose payload is still to be verified."""
        return np.asarray(self._state[np.asarray(pages, dtype=np.int64)] == DigestState.EXPECTED)

    def _set(self, page: int, digest: bytes, state: DigestState) -> None:
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a page digest is {DIGEST_BYTES} bytes, got {len(digest)}")
        self._digest[page] = np.frombuffer(digest, dtype=np.uint8)
        self._state[page] = state
