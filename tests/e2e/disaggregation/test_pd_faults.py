"""Faults between a prefill and a decode ``hicache serve``: a side that never comes, a
decode instance killed after its handshake, a prefill instance killed while decode waits.
The request fails alone, with a clear error, and the survivor's pools are intact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dev_dependency import require_dev_dependency
from tests.pd_fixtures import TIMEOUT_S, PDPair, check_integrity, pd_pair
from tests.waiting import wait_until

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

# The pair's one transfer timeout bounds its successful transfers too: far above what a
# machine busy with other work takes to send a tiny prompt's KV.
TRANSFER_TIMEOUT_S = 10.0
# Above a failure's own wait (its transfer timeout, where it has one): scheduling on a
# machine busy with other work. What these bounds tell apart is a request that fails at
# all from one that hangs; which wait ended it, the error message says.
LATE_S = 30.0
# Until the decode instance registered a room: a guard against a hang, not a bound.
REGISTER_S = 60.0
ARGS = ["--device", "cpu", "--max-total-tokens", "1024", "--model-preset", "tiny",
        "--page-size", "16", "--hicache-storage-backend", "none",
        "--disaggregation-transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
BODY = {"input_ids": list(range(1, 50)),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[PDPair]:
    with pd_pair(ARGS, tmp_path) as running:
        yield running


def _rooms(pair: PDPair) -> int:
    answer = httpx.get(f"http://127.0.0.1:{pair.bootstrap_port}/health", timeout=LATE_S).json()
    return int(answer["rooms"])


def _error(response: httpx.Response | None) -> str:
    assert response is not None and response.status_code == 500, response and response.text
    message: str = response.json()["error"]["message"]
    return message


def _in_background(pair: PDPair, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    """``pair.send`` on a thread; its answer, or the error it raised (a killed server)."""
    answers: list[Any] = []

    def send() -> None:
        try:
            answers.append(pair.send("/generate", BODY, **kwargs))
        except httpx.TransportError as error:
            answers.append(error)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answers


def _wait_for_a_room(pair: PDPair) -> None:
    assert wait_until(lambda: _rooms(pair) > 0, REGISTER_S), (
        "the decode instance never registered its room")


def _timed_send(pair: PDPair, **kwargs: Any) -> tuple[httpx.Response | None,
                                                       httpx.Response | None, float]:
    began = time.monotonic()
    prefill, decode = pair.send("/generate", BODY, **kwargs)
    return prefill, decode, time.monotonic() - began


def test_sides_that_never_meet_fail_alone_and_leak_nothing(pair: PDPair) -> None:
    # Both at once, each with a room of its own: one wait for the transfer timeout, not two.
    with ThreadPoolExecutor(2) as pool:
        decode_only = pool.submit(_timed_send, pair, to_prefill=False)
        prefill_only = pool.submit(_timed_send, pair, to_decode=False)
        _, decode, decode_s = decode_only.result()
        prefill, _, _ = prefill_only.result()
    assert "timed out" in _error(decode)
    assert TRANSFER_TIMEOUT_S <= decode_s < TRANSFER_TIMEOUT_S + LATE_S
    assert "no decode instance registered" in _error(prefill)
    # A prefill that ends with no KV to send (no token asked for) tells decode at once:
    # decode answers with the prefill's reason, where one left to its transfer timeout
    # would say "timed out" (a wall-clock bound here would only measure the machine).
    nothing = {**BODY, "sampling_params": {"max_new_tokens": 0}}
    prefill, decode = pair.send("/generate", nothing)
    assert prefill is not None and prefill.status_code == 200
    assert "without sending its KV" in _error(decode)
    # Both still serve: a request sent to both succeeds.
    assert len(pair.generate(BODY)["output_ids"]) == 8
    check_integrity(pair.prefill)
    check_integrity(pair.decode)


def test_decode_killed_after_its_handshake(pair: PDPair) -> None:
    room = 424242
    thread, answers = _in_background(pair, room=room, to_prefill=False)
    _wait_for_a_room(pair)
    pair.decode.kill()
    thread.join(timeout=TIMEOUT_S)
    assert isinstance(answers[0], httpx.TransportError)  # the client lost the decode server
    began = time.monotonic()
    prefill, _ = pair.send("/generate", BODY, room=room, to_decode=False)
    assert "KV transfer to the decode instance failed" in _error(prefill)
    assert time.monotonic() - began < TRANSFER_TIMEOUT_S + LATE_S
    check_integrity(pair.prefill)


def test_prefill_killed_while_decode_waits(pair: PDPair) -> None:
    thread, answers = _in_background(pair, to_prefill=False)
    _wait_for_a_room(pair)
    pair.prefill.kill()
    killed = time.monotonic()
    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    _, decode = answers[0]
    assert "unreachable" in _error(decode)
    assert time.monotonic() - killed < TRANSFER_TIMEOUT_S + LATE_S
    check_integrity(pair.decode)
