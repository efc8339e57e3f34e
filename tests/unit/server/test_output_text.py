"""OutputText: the text a request asked for (special tokens kept or skipped, stops trimmed
or not) and what stopped it, from the engine's outputs, with the byte-level tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hicache.engine.api import CachedTokens, GenerateOutput, SamplingParams
from hicache.server.output_text import OutputText, TextOptions, finish_reason
from hicache.tokenizer.byte_level import ByteTokenizer

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids[0]
SYSTEM = TOKENIZER.encode("<|system|>", add_special_tokens=False)[0]  # a special, not a stop


def outputs(
    steps: Sequence[tuple[Sequence[int], str]], reason: str | None
) -> list[GenerateOutput]:
    """Engine outputs: (new ids, new engine text) per step; the last one finishes."""
    out = []
    total = 0
    for i, (ids, text) in enumerate(steps):
        total += len(ids)
        last = i == len(steps) - 1
        out.append(GenerateOutput("r", tuple(ids), text, last, reason if last else None,
                                  3, total, CachedTokens()))
    return out


def run(
    steps: Sequence[tuple[Sequence[int], str]], reason: str, sampling: SamplingParams,
    options: TextOptions,
) -> tuple[list[str], OutputText]:
    text = OutputText(TOKENIZER, [1, 2, 3], sampling, options, TOKENIZER.eos_token_ids)
    deltas = [text.push(o) for o in outputs(steps, reason)]
    return deltas, text


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_engine_text_passes_through_and_the_stop_token_is_matched() -> None:
    steps = [(ids("ab"), "ab"), ([SYSTEM], ""), ([*ids("c"), EOS], "c")]
    deltas, text = run(steps, "stop", SamplingParams(), TextOptions())
    assert deltas == ["ab", "", "c"] and text.text == "abc"
    assert text.matched == EOS
    assert text.token_ids == [*ids("ab"), SYSTEM, *ids("c"), EOS]


def test_special_tokens_kept_when_asked_but_not_the_stop_token() -> None:
    steps = [(ids("ab"), "ab"), ([SYSTEM], ""), ([*ids("c"), EOS], "c")]
    _, kept = run(steps, "stop", SamplingParams(), TextOptions(skip_special_tokens=False))
    assert kept.text == "ab<|system|>c"
    assert kept.matched == EOS
    _, untrimmed = run(steps, "stop", SamplingParams(),
                       TextOptions(skip_special_tokens=False, no_stop_trim=True))
    assert untrimmed.text == "ab<|system|>c<|eos|>"


def test_stop_string_matched_trimmed_or_kept() -> None:
    sampling = SamplingParams(stop=("zz", "END"))
    # The engine stopped on "END" and trimmed it (and what followed in that token).
    steps = [(ids("hello "), "hello "), (ids("wENDx"), "w")]
    deltas, trimmed = run(steps, "stop", sampling, TextOptions())
    assert trimmed.text == "hello w" and trimmed.matched == "END"
    deltas, kept = run(steps, "stop", sampling, TextOptions(no_stop_trim=True))
    assert "".join(deltas) == kept.text == "hello wENDx"
    assert kept.matched == "END"


def test_own_decoding_holds_back_a_possible_stop_string() -> None:
    sampling = SamplingParams(stop=("END",))
    steps = [(ids("abE"), "ab"), (ids("N"), ""), (ids("Dq"), "")]
    deltas, text = run(steps, "stop", sampling, TextOptions(skip_special_tokens=False))
    # "E" and "EN" could start the stop string: never shown, and gone once it completes.
    assert deltas == ["a", "b", ""]
    assert text.text == "ab" and text.matched == "END"


@pytest.mark.parametrize(
    ("reason", "error", "expected"),
    [
        ("length", None, {"type": "length", "length": 4}),
        ("stop", None, {"type": "stop", "matched": 7}),
        ("abort", "device lost", {"type": "abort", "message": "device lost"}),
    ],
)
def test_finish_reason_is_sglangs_dict(
    reason: str, error: str | None, expected: dict[str, object]
) -> None:
    last = GenerateOutput("r", (), "", True, reason, 3, 4, CachedTokens(), error=error)
    assert finish_reason(last, 7) == expected
    running = GenerateOutput("r", (5,), "x", False, None, 3, 1, CachedTokens())
    assert finish_reason(running, None) is None
