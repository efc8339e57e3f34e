"""The prompts the router routed most recently, for warming a worker that joins.

Each prompt a worker answered (200) is recorded as its token ids, the ids its worker
cached. A conversation's next turn extends its last prompt, so prompts are
deduplicated by their first pages (``DEDUP_PAGES``, through the chained page hash of
the last of them): a later prompt with the same opening replaces the earlier one and
becomes the most recent. Prompts shorter than a page are not kept: a warm moves
whole pages.

Bounded: at most ``max_entries`` prompts and ``max_tokens`` token ids in all (the
oldest go first), each stored as packed 32-bit ids. Lives on the router's event
loop: no locking.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

# Prompts sharing this many leading pages are one conversation's turns.
DEDUP_PAGES = 4
DEFAULT_MAX_ENTRIES = 1024  # a worker's /hicache/warm takes at most this many prefixes
DEFAULT_MAX_TOKENS = 4_000_000  # 16 MB of packed ids


class RequestHistory:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_entries <= 0 or max_tokens <= 0:
            raise ValueError("a request history holds at least one prompt and one token")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        # dedup key -> token ids; the most recent last.
        self._prompts: OrderedDict[int, array[int]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def record(self, token_ids: Sequence[int], page_hashes: Sequence[int]) -> None:
        """A prompt a worker answered: ``token_ids`` and its full pages' chained hashes."""
        if not page_hashes or len(token_ids) > self.max_tokens:
            return
        try:
            ids = array("i", token_ids)
        except (OverflowError, TypeError):  # not ids a worker could have cached
            return
        key = page_hashes[min(len(page_hashes), DEDUP_PAGES) - 1]
        old = self._prompts.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        self._prompts[key] = ids
        self._tokens += len(ids)
        while len(self._prompts) > self.max_entries or self._tokens > self.max_tokens:
            _, dropped = self._prompts.popitem(last=False)
            self._tokens -= len(dropped)

    def recent(self, budget_tokens: int, page_size: int, max_items: int,
               max_tokens_each: int | None = None) -> list[list[int]]:
        """The most recent prompts first, as many as fit ``budget_tokens`` (each counted
        by its whole pages, what a warm can hold) up to ``max_items``; a prompt longer
        than ``max_tokens_each`` is cut to it. A prompt that does not fit is skipped and
        older, shorter ones may still fit."""
        out: list[list[int]] = []
        left = budget_tokens
        for ids in reversed(self._prompts.values()):
            if len(out) >= max_items or left < page_size:
                break
            length = len(ids) if max_tokens_each is None else min(len(ids), max_tokens_each)
            pages_tokens = length // page_size * page_size
            if pages_tokens == 0 or pages_tokens > left:
                continue
            out.append(ids[:length].tolist())
            left -= pages_tokens
        return out
