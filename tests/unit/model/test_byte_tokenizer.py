"""The byte-level fallback tokenizer: specials found in one pass, the same ids as ever.

``reference_encode`` is the original algorithm (find the earliest special in
what is left, encode the bytes before it, repeat): exact but quadratic in the
number of specials. The tokenizer must give its ids for any text, and encode a
megabyte full of specials in well under a second where the reference took
minutes.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.load import load_tokenizer

MEGABYTE = 2**20


def reference_encode(text: str) -> list[int]:
    """The original ByteTokenizer.encode (no BOS): one search per special per step."""
    specials = {s: 256 + i for i, s in enumerate(ByteTokenizer.SPECIALS)}
    ids: list[int] = []
    rest = text
    while rest:
        hits = [(rest.find(s), s) for s in specials if s in rest]
        at, special = min(hits) if hits else (len(rest), "")
        ids += rest[:at].encode("utf-8")
        if special:
            ids.append(specials[special])
        rest = rest[at + len(special) :]
    return ids


# Pieces that make near-misses, overlaps and adjacent specials likely.
PIECES = [*ByteTokenizer.SPECIALS, "<|", "|>", "<", "|", ">", "<|eos", "eos|>", "<|<|end|>",
          "a", " ", "é", "中", "😀", "\n", "<|unknown|>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40))
def test_ids_equal_the_original_algorithm(pieces: list[str]) -> None:
    text = "".join(pieces)
    tokenizer = ByteTokenizer()
    assert tokenizer.encode(text, add_special_tokens=False) == reference_encode(text)
    assert tokenizer.encode(text) == [tokenizer.bos_token_id, *reference_encode(text)]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == \
        "<|bos|>" + text


@pytest.mark.parametrize(("text", "ids"), [
    ("", []),
    ("ab", [97, 98]),
    ("<|eos|>", [257]),
    ("a<|eos|>b", [97, 257, 98]),
    ("<|end|><|eos|>", [261, 257]),
    ("<|<|end|>", [60, 124, 261]),
    ("<|eos", [60, 124, 101, 111, 115]),
    ("é<|user|>", [0xC3, 0xA9, 259]),
    ("<|bos|><|system|>s<|end|><|assistant|>", [256, 258, 115, 261, 260]),
])
def test_known_ids(text: str, ids: list[int]) -> None:
    assert ByteTokenizer().encode(text, add_special_tokens=False) == ids


@pytest.mark.timeout(60)  # the quadratic original took minutes here
def test_a_megabyte_full_of_specials_encodes_in_linear_time() -> None:
    unit = "aaaa<|eos|>bb<|end|>"
    text = unit * (MEGABYTE // len(unit))
    tokenizer = ByteTokenizer()
    started = time.perf_counter()
    ids = tokenizer.encode(text, add_special_tokens=False)
    elapsed_s = time.perf_counter() - started
    # About 0.1 s on a quiet machine, a few times that on a busy one: far under the bound,
    # which a quadratic encoder (minutes) is far over.
    assert elapsed_s < 20.0, f"encoding 1 MB took {elapsed_s:.1f} s"
    assert ids == ([97] * 4 + [257] + [98] * 2 + [261]) * (len(text) // len(unit))


def test_the_models_eos_ids_replace_the_specials_as_stops() -> None:
    # Without the model's ids (dummy weights) the specials end generation; a model that
    # names its own (config.json, generation_config.json) ends on those alone.
    assert ByteTokenizer().eos_token_ids == (257, 261)
    assert ByteTokenizer(eos_token_ids=[7, 300, 7]).eos_token_ids == (7, 300)
    assert load_tokenizer(None, extra_eos_token_ids=(5,)).eos_token_ids == (5,)
