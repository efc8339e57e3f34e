"""Lookups of the shared L3 pool: which of a request's pages it holds.

``InMemorySharedPool`` answers from a set of page hashes (tests, and the
decision benchmark, which measures the router's own cost).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class InMemorySharedPool:
    """A ``SharedPoolLookup`` over a set of page hashes, answered at once."""

    def __init__(self, page_hashes: Iterable[int] = ()) -> None:
        self.pages = set(page_hashes)
        self.num_queries = 0

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        self.num_queries += 1
        pages = self.pages
        return [page in pages for page in page_hashes]
