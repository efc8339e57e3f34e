"""``Req.match_key``: the tokens a request may reuse, packed once for the cache's lookups."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hicache.engine.api import GenerateRequest, LogprobParams
from hicache.engine.request import Req
from hicache.radix.keys import PackedTokens, num_tokens, pack_tokens


def _req(prompt: list[int], logprobs: LogprobParams | None = None) -> Req:
    stub: Any = None  # neither the stream nor the detokenizer is touched here
    return Req(GenerateRequest(tuple(prompt), logprobs=logprobs), "r", stub, stub, None)


@pytest.mark.parametrize("outputs", [0, 1, 5])
@pytest.mark.parametrize("input_from", [None, 0, 3, 9])
def test_the_key_is_the_packed_match_tokens(outputs: int, input_from: int | None) -> None:
    prompt = list(range(100, 112))
    params = None if input_from is None else LogprobParams(input_from=input_from)
    req = _req(prompt, params)
    for step in range(outputs):  # outputs a retracted request carries back to the queue
        req.output_ids.append(500 + step)
    key = req.match_key()
    assert isinstance(key, PackedTokens)
    assert key == pack_tokens(req.match_tokens())
    assert key.num_tokens == num_tokens(key) == len(req.match_tokens())
    # It follows the request: one more output, one more token to match (unless the
    # prompt's logprobs still hold it back).
    req.output_ids.append(999)
    assert req.match_key() == pack_tokens(req.match_tokens())


def test_packed_tokens_pass_through_pack_tokens_untouched() -> None:
    packed = PackedTokens(pack_tokens([1, 2, 3]))
    assert pack_tokens(packed) is packed
    assert num_tokens(packed) == 3 and num_tokens([1, 2, 3]) == 3
    assert num_tokens(np.arange(4)) == 4
    # Plain bytes are not taken for packed tokens: they are refused as before.
    with pytest.raises(ValueError):
        pack_tokens(bytes(pack_tokens([1, 2, 3])))
