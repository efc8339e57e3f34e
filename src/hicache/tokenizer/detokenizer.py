"""Streaming detokenization: text deltas as tokens arrive, never half a character."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.tokenizer.base import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token sequence into the new text each token adds.

    Decoding token by token breaks text two ways: a character whose UTF-8 bytes
    span several byte-level tokens decodes as U+FFFD until its last byte arrives,
    and tokenizers that mark word starts (SentencePiece's "▁") drop a leading
    space when a token is decoded without the one before it. So each step decodes
    a short window that starts a few tokens back (``prefix`` = the tokens already
    emitted in the window), emits what the window adds past the prefix, and holds
    everything back while the window ends in U+FFFD (an unfinished character).
    Cost per token: the window, not the whole text.

    ``prompt_ids`` seeds the window so the first generated token decodes in context.
    A genuine U+FFFD at the very end is released by ``flush()``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        context_tokens: int = 6,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are emitted
        self.text = ""  # everything emitted so far

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Append tokens; returns the text they complete ("" if none yet)."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT):
            return ""
        delta = window[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, U+FFFD included."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        delta = window[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
