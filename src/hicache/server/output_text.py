"""A request's output text as the client asked for it, and what ended it.

The engine streams text with special tokens skipped and trimmed at the stop
string or token that ended the request. That is what most requests want, and
then it is passed on as is. A request with ``skip_special_tokens: false`` or
``no_stop_trim: true`` gets text decoded here from the output token ids:
special tokens kept, and (no_stop_trim) the stop string or token left in. In
both cases ``matched`` says what stopped the request (SGLang's
``finish_reason.matched``): the stop token id, or the stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.engine.api import GenerateOutput, SamplingParams
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class TextOptions:
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def engine_text(self) -> bool:
        """Whether the engine's own text is what the request asked for."""
        return self.skip_special_tokens and not self.no_stop_trim


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string starts, and which (the first listed on a tie)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class OutputText:
    """Feed it a request's outputs in order; ``push`` returns the text each one adds."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams,
        options: TextOptions, eos_token_ids: Iterable[int],
    ) -> None:
        self._tokenizer = tokenizer
        self._options = options
        self._stops = sampling.stop
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._detokenizer = (
            None if options.engine_text else IncrementalDetokenizer(
                tokenizer, prompt_ids, skip_special_tokens=options.skip_special_tokens
            )
        )
        self._raw = ""  # decoded here, stop strings not trimmed (own decoding only)
        self.token_ids: list[int] = []
        self.text = ""
        self.matched: int | str | None = None

    def push(self, output: GenerateOutput) -> str:
        new_ids = list(output.token_ids)
        self.token_ids.extend(new_ids)
        stopped = output.finished and output.finish_reason == "stop"
        if stopped and self.token_ids and self.token_ids[-1] in self._stop_ids:
            self.matched = self.token_ids[-1]
        own = self._detokenizer is not None
        delta = self._decode(new_ids, output.finished) if own else output.text
        self.text += delta
        if stopped and self.matched is None and self._stops:
            self.matched = self._matched_string()
        return delta

    def _decode(self, new_ids: list[int], final: bool) -> str:
        assert self._detokenizer is not None
        if final and isinstance(self.matched, int) and not self._options.no_stop_trim:
            new_ids = new_ids[:-1]  # the stop token: left out, as by the engine
        self._raw += self._detokenizer.push(new_ids)
        if final:
            self._raw += self._detokenizer.flush()
        visible = self._raw
        if self._stops and not self._options.no_stop_trim:
            found = _earliest_stop(self._raw, self._stops)
            if found is not None:
                visible = self._raw[: found[0]]
            elif not final:
                # Hold back what may be the start of a stop string.
                visible = self._raw[: len(self._raw) - (max(len(s) for s in self._stops) - 1)]
        visible = visible if len(visible) >= len(self.text) else self.text
        return visible[len(self.text) :]

    def _matched_string(self) -> str | None:
        if self._detokenizer is not None:
            text = self._raw
        else:  # the engine trimmed its text: decode once more to see the stop string
            text = self._tokenizer.decode(self.token_ids)
        found = _earliest_stop(text, self._stops)
        return found[1] if found is not None else None


def finish_reason(output: GenerateOutput, matched: int | str | None) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason``; None until the request has ended."""
    if not output.finished:
        return None
    if output.finish_reason == "length":
        return {"type": "length", "length": output.completion_tokens}
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": output.error or "the request was aborted"}
