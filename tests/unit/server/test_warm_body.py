"""The warm's body checks (``server/warm.py``): exactly one of input_ids or text, not
empty, at most MAX_ITEMS, ids inside the vocabulary, prompts inside the context; and the
--warm-host-fraction flag takes a share in (0, 1]."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.cli import build_parser
from hicache.server.errors import APIError
from hicache.server.warm import (
    DEFAULT_WARM_HOST_FRACTION,
    MAX_ITEMS,
    WarmRequest,
    validate_items,
)

VOCAB = 100
CONTEXT = 50


def check(body: dict[str, Any]) -> list[list[int] | str]:
    return validate_items(WarmRequest.model_validate(body), VOCAB, CONTEXT)


def test_ids_and_texts_pass_through_in_order() -> None:
    assert check({"input_ids": [[1, 2], [99]]}) == [[1, 2], [99]]
    assert check({"text": ["a", "b"]}) == ["a", "b"]
    assert len(check({"text": ["x"] * MAX_ITEMS})) == MAX_ITEMS


@pytest.mark.parametrize(("body", "message"), [
    ({}, "exactly one of input_ids"),
    ({"input_ids": [[1]], "text": ["a"]}, "exactly one of input_ids"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"text": ["a", ""]}, "text[1] is empty"),
    ({"input_ids": [[1], [2, VOCAB, -1]]}, f"input_ids[1] has token ids out of the vocabulary "
                                          f"[0, {VOCAB}): [{VOCAB}, -1]"),
    ({"input_ids": [[1] * (CONTEXT + 1)]}, f"longer than the context ({CONTEXT})"),
    ({"text": ["x"] * (MAX_ITEMS + 1)}, f"at most {MAX_ITEMS} per call"),
])
def test_bad_bodies_are_a_400_naming_the_problem(body: dict[str, Any], message: str) -> None:
    with pytest.raises(APIError) as raised:
        check(body)
    assert raised.value.status == 400
    assert message in raised.value.message


def test_the_flag_takes_a_share_of_the_host_pool() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).warm_host_fraction == DEFAULT_WARM_HOST_FRACTION
    assert parser.parse_args(["serve", "--warm-host-fraction", "0.25"]).warm_host_fraction == 0.25
    for bad in ("0", "1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--warm-host-fraction", bad])
