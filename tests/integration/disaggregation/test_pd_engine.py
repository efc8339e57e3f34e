"""A decode engine in this process, against a bootstrap server of this test (a prefill
side that never sends KV): a request aborted while it waits for its KV gives its room up
and frees its pages at once, not at its transfer timeout; the logprobs a room ends with
are the answer's, and ones that do not answer the request fail it cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hicache.disaggregation.bootstrap_server import BootstrapServer
from hicache.disaggregation.rooms import RoomState, RoomTable
from hicache.engine.api import (
    Bootstrap,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
    TokenLogprob,
)
from hicache.engine.engine import Engine
from hicache.engine.logprobs import handoff_logprobs
from tests.dev_dependency import require_dev_dependency
from tests.engine_helpers import collect
from tests.server_fixtures import build_test_engine
from tests.waiting import wait_until, wait_until_async

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

# The transfer timeout an abort must not wait for: far past ABORT_S, so that a machine busy
# with other work stays far under the bound and a request held to its timeout is far over.
TIMEOUT_S = 240.0
ABORT_S = 30.0
# Until the decode engine registered its room: a guard against a hang, not a bound.
REGISTER_S = 60.0


@pytest.fixture(name="rooms")
def rooms_fixture() -> Iterator[tuple[RoomTable, int]]:
    rooms = RoomTable(stale_after_s=60)
    server = BootstrapServer(rooms, "127.0.0.1", 0).start()
    yield rooms, server.port
    server.close()


@pytest.fixture(name="decode")
def decode_fixture() -> Iterator[Engine]:
    engine = build_test_engine([
        "--disaggregation-mode", "decode",
        "--disaggregation-transfer-timeout-s", str(TIMEOUT_S),
    ])
    yield engine
    engine.shutdown()


def test_abort_while_waiting_for_kv_gives_the_room_up(
    rooms: tuple[RoomTable, int], decode: Engine
) -> None:
    table, port = rooms
    request = GenerateRequest(tuple(range(1, 40)), SamplingParams(max_new_tokens=4),
                              rid="waiting", bootstrap=Bootstrap("127.0.0.1", port, 5))
    allocator = decode.cache.device_pool.allocator

    async def scenario() -> str | None:
        task = asyncio.ensure_future(collect(decode, request))
        assert await wait_until_async(
            lambda: table.status(5, 0).state is RoomState.REGISTERED, REGISTER_S
        ), "the decode engine never registered its room"
        assert allocator.num_used_pages == 3  # its 39 prompt tokens' pages, held
        assert not decode.is_idle()
        decode.abort("waiting")
        # Ended by the abort, not at the transfer timeout (wait_for raises past ABORT_S).
        run = await asyncio.wait_for(task, timeout=ABORT_S)
        return run.last.finish_reason

    assert asyncio.run(scenario()) == "abort"
    assert allocator.num_used_pages == 0
    assert decode.is_idle()
    decode.check_integrity()


def _finish_room_once_registered(table: RoomTable, room: int, token: int,
                                 logprobs: dict[str, Any] | None) -> None:
    """Play the prefill side: end the room with a first token (and these logprobs) once the
    decode engine registered it (no KV is written: its pages keep what they held)."""
    assert wait_until(
        lambda: table.status(room, 0).state is RoomState.REGISTERED, REGISTER_S
    ), "the decode engine never registered its room"
    table.finish(room, token, None, logprobs)


def _logprob_request(port: int, room: int) -> GenerateRequest:
    # 39 prompt tokens, logprobs from position 37: two prompt entries; the top 1 of each.
    return GenerateRequest(
        tuple(range(1, 40)), SamplingParams(max_new_tokens=3, temperature=0.0),
        rid=f"logprobs-{room}", bootstrap=Bootstrap("127.0.0.1", port, room),
        logprobs=LogprobParams(top_n=1, input_from=37),
    )


def test_the_prefill_instances_logprobs_are_the_answers(
    rooms: tuple[RoomTable, int], decode: Engine
) -> None:
    table, port = rooms
    prompt = [TokenLogprob(38, -1.5, top=((7, -0.25),)), TokenLogprob(39, -2.0, top=((39, -2.0),))]
    first = TokenLogprob(17, -0.75, top=((17, -0.75),))
    wire = handoff_logprobs(prompt, first)
    with ThreadPoolExecutor(1) as prefill_side:
        prefill_side.submit(_finish_room_once_registered, table, 31, 17, wire)
        run = asyncio.run(collect(decode, _logprob_request(port, 31)))
    assert run.last.finish_reason == "length"
    assert run.token_ids[0] == 17 and len(run.token_ids) == 3
    outputs = [entry for out in run.outputs for entry in out.output_logprobs]
    inputs = [entry for out in run.outputs for entry in out.input_logprobs]
    assert inputs == prompt
    assert outputs[0] == first and len(outputs) == 3
    assert all(e.logprob is not None and len(e.top) == 1 for e in outputs[1:])  # computed here
    decode.check_integrity()


@pytest.mark.parametrize("sent, reason", [
    (None, "sent none"),
    (handoff_logprobs([], TokenLogprob(17, -0.75, top=((17, -0.75),))), "asks for 2"),
    (handoff_logprobs([TokenLogprob(38, -1.5, top=((7, -0.25),))] * 2,
                      TokenLogprob(99, -0.75, top=((99, -0.75),))), "token 99"),
])
def test_logprobs_that_do_not_answer_the_request_fail_it_cleanly(
    rooms: tuple[RoomTable, int], decode: Engine, sent: dict[str, Any] | None, reason: str,
) -> None:
    table, port = rooms
    with ThreadPoolExecutor(1) as prefill_side:
        prefill_side.submit(_finish_room_once_registered, table, 32, 17, sent)
        run = asyncio.run(collect(decode, _logprob_request(port, 32)))
    assert run.last.finish_reason == "abort"
    assert reason in str(run.last.error)
    assert decode.cache.device_pool.allocator.num_used_pages == 0
    decode.check_integrity()
