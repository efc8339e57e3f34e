"""The engine's log probabilities (``TokenLogprob``) in each API's response shapes.

SGLang's ``meta_info``: ``input_token_logprobs`` / ``output_token_logprobs`` as
lists of ``[logprob, token_id, text or None]`` (the prompt's first token has a
``None`` logprob), ``*_top_logprobs`` a list of such lists per position (None
for the prompt's first), ``*_token_ids_logprobs`` the asked tokens' per
position; the text only with ``return_text_in_logprobs``. OpenAI completions:
``tokens`` / ``token_logprobs`` / ``top_logprobs`` (a dict of the top N and
the chosen token) / ``text_offset``; chat: ``content`` entries with ``token``,
``logprob``, ``bytes`` and ``top_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.engine.api import LogprobParams, TokenLogprob
from hicache.tokenizer.base import Tokenizer


class TokenTexts:
    """Each token's own text, decoded once (special tokens kept: they are the token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _triple(logprob: float | None, token_id: int, texts: TokenTexts | None) -> list[Any]:
    return [logprob, token_id, texts(token_id) if texts is not None else None]


def sglang_fields(
    params: LogprobParams, inputs: Sequence[TokenLogprob], outputs: Sequence[TokenLogprob],
    texts: TokenTexts | None,
) -> dict[str, Any]:
    """The logprob entries of SGLang's meta_info (``texts``: return_text_in_logprobs)."""

    def tokens(entries: Sequence[TokenLogprob]) -> list[list[Any]]:
        return [_triple(e.logprob, e.token_id, texts) for e in entries]

    def tops(entries: Sequence[TokenLogprob]) -> list[list[list[Any]] | None]:
        return [None if e.logprob is None else [_triple(lp, t, texts) for t, lp in e.top]
                for e in entries]

    def asked(entries: Sequence[TokenLogprob]) -> list[list[list[Any]] | None]:
        return [None if e.logprob is None else
                [_triple(lp, t, texts) for t, lp in zip(params.token_ids, e.asked, strict=True)]
                for e in entries]

    fields: dict[str, Any] = {
        "input_token_logprobs": tokens(inputs),
        "output_token_logprobs": tokens(outputs),
    }
    if params.top_n > 0:
        fields["input_top_logprobs"] = tops(inputs)
        fields["output_top_logprobs"] = tops(outputs)
    if params.token_ids:
        fields["input_token_ids_logprobs"] = asked(inputs)
        fields["output_token_ids_logprobs"] = asked(outputs)
    return fields


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` object; offsets count from ``text_offset``."""
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float] | None] = []
    for entry in entries:
        token = texts(entry.token_id)
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        if entry.logprob is None:
            top.append(None)
            continue
        # The top N and, always, the chosen token (OpenAI: up to N + 1 entries). Tokens
        # that decode to the same text keep the most likely one's logprob.
        best: dict[str, float] = {}
        for t, lp in entry.top:
            best.setdefault(texts(t), lp)
        best.setdefault(token, entry.logprob)
        top.append(best)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    token = texts(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """OpenAI's chat choice ``logprobs`` object (``content``; ``refusal`` never set)."""
    content = []
    for entry in entries:
        assert entry.logprob is not None  # output tokens always have one
        item = _chat_entry(entry.token_id, entry.logprob, texts)
        item["top_logprobs"] = [_chat_entry(t, lp, texts) for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}
