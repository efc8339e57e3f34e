"""The logprobs a prefill instance hands to the decode instance with the first token:
their JSON round trip, and the refusals when they do not answer the request."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.disaggregation.rooms import Registration, RoomState, RoomTable
from hicache.engine.api import LogprobParams, TokenLogprob
from hicache.engine.logprobs import first_prompt_token, handoff_logprobs, received_logprobs
from tests.decode_peer import make_pool

PARAMS = LogprobParams(top_n=2, token_ids=(4, 7), input_from=0)


def _entry(token: int, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, top=((token, logprob), (3, logprob - 1.5)),
                        asked=(-9.25, -11.0))


def test_the_handoff_survives_json_exactly() -> None:
    inputs = [first_prompt_token(11), _entry(12, -0.75), _entry(13, -2.0625)]
    first = _entry(40, -0.125)
    wire = json.loads(json.dumps(handoff_logprobs(inputs, first)))
    got_inputs, got_first = received_logprobs(wire, PARAMS)
    assert got_inputs == inputs and got_first == first


def test_very_unlikely_tokens_keep_their_logprob() -> None:
    first = TokenLogprob(5, -1e30, top=((1, -0.1), (5, -1e30)), asked=(-math.inf, -3.0))
    wire = json.loads(json.dumps(handoff_logprobs([], first)))  # Python's JSON: -Infinity
    assert received_logprobs(wire, PARAMS)[1] == first


@pytest.mark.parametrize("data, message", [
    (None, "malformed"),
    ({"input": []}, "malformed"),
    ({"input": [[1, -0.5]], "first": [2, -0.5, [], []]}, "malformed"),
    ({"input": [], "first": [2, "x", [], []]}, "malformed"),
    ({"input": [], "first": [2, None, [], []]}, "no logprob for the first token"),
    # top_n 2 asked; one sent
    ({"input": [], "first": [2, -0.5, [[2, -0.5]], [-1.0, -2.0]]}, "top_logprobs_num"),
    # two asked tokens; one sent
    ({"input": [], "first": [2, -0.5, [[2, -0.5], [1, -1.0]], [-1.0]]}, "token_ids_logprob"),
])
def test_logprobs_that_do_not_answer_the_request_are_refused(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        received_logprobs(data, PARAMS)


def test_a_room_keeps_logprobs_only_when_done() -> None:
    rooms = RoomTable(stale_after_s=60)
    wire = handoff_logprobs([], _entry(40, -0.125))
    rooms.finish(1, 40, None, wire)
    done = rooms.status(1, 0)
    assert (done.state, done.first_token, done.logprobs) == (RoomState.DONE, 40, wire)
    rooms.register(2, Registration("s", PoolDescriptor.of(make_pool()), np.array([0])))
    rooms.finish(2, None, "the transfer failed", wire)
    failed = rooms.status(2, 0)
    assert (failed.state, failed.logprobs) == (RoomState.FAILED, None)
