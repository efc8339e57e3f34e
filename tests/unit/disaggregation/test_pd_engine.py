"""A decode engine in this process, against a bootstrap server of this test (a prefill
side that never sends): a request aborted while it waits for its KV gives its room up
and frees its pages at once, not at its transfer timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from hicache.disaggregation.bootstrap_server import BootstrapServer
from hicache.disaggregation.rooms import RoomState, RoomTable
from hicache.engine.api import Bootstrap, GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from tests.dev_dependency import require_dev_dependency
from tests.engine_helpers import collect
from tests.server_fixtures import build_test_engine

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

TIMEOUT_S = 20.0


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
        deadline = time.monotonic() + 10
        while table.status(5, 0).state is not RoomState.REGISTERED:
            assert time.monotonic() < deadline, "the decode engine never registered its room"
            await asyncio.sleep(0.01)
        assert allocator.num_used_pages == 3  # its 39 prompt tokens' pages, held
        assert not decode.is_idle()
        decode.abort("waiting")
        run = await asyncio.wait_for(task, timeout=5)
        return run.last.finish_reason

    began = time.monotonic()
    assert asyncio.run(scenario()) == "abort"
    assert time.monotonic() - began < TIMEOUT_S / 2
    assert allocator.num_used_pages == 0
    assert decode.is_idle()
    decode.check_integrity()
