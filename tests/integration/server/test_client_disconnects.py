"""A client that leaves aborts its request before the engine's next step: a queued one is
dropped from the waiting queue without being prefilled, a running one stops decoding.

The issue's reproduction, made inside the test: long generations hold every running
slot (``--max-running-requests``), clients send long prompts on every route, streamed
and not, wait until the engine has queued them all, and leave. The prompt tokens the
engine computed (``hicache_prefill_step_tokens_total``) must not grow at all, and
/metrics counts the aborts by phase.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from tests.abandoned_clients import held_request, leave, long_prompt, scrape
from tests.server_fixtures import RunningServer, long_stream, serve_in_thread

HOLDERS = 2
PROMPT_TOKENS = 1500
# Generous: events are waited for, this only bounds a failing test.
DEADLINE_S = 60.0
ABORTED = "hicache_requests_aborted_total"
PREFILLED = "hicache_prefill_step_tokens_total"


def by_phase(phase: str) -> str:
    return f'hicache_requests_aborted_by_phase_total{{phase="{phase}"}}'


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # Room for both holders' whole contexts: nothing is ever retracted (and re-prefilled).
    args = ["--max-running-requests", str(HOLDERS), "--max-total-tokens", "20000"]
    with serve_in_thread(args) as running:
        yield running


def _abandoned(index: int) -> tuple[str, dict[str, Any]]:
    """One long-prompt request per route and streaming mode."""
    ids = long_prompt(index, PROMPT_TOKENS)
    sampling = {"max_new_tokens": 8, "ignore_eos": True}
    routes: list[tuple[str, dict[str, Any]]] = [
        ("/generate", {"input_ids": ids, "sampling_params": sampling}),
        ("/generate", {"input_ids": ids, "sampling_params": sampling, "stream": True}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 8}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 8, "stream": True}),
        ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"question {index} " * 400}],
            "max_tokens": 8, "stream": index % 2 == 0,
        }),
        ("/generate", {"input_ids": [ids, long_prompt(index + 100, PROMPT_TOKENS)],
                       "sampling_params": sampling}),  # a batch: both prompts queue
    ]
    return routes[index % len(routes)]


def test_clients_that_leave_while_queued_cost_no_prefill(server: RunningServer) -> None:
    engine = server.engine
    with ExitStack() as holders:
        for _ in range(HOLDERS):
            holders.enter_context(long_stream(server))
        assert engine.metrics()["engine_running_requests"] == HOLDERS
        before = scrape(server.url)

        sockets = []
        queued = 0
        for index in range(12):
            path, payload = _abandoned(index)
            sockets.append(held_request(server.url, path, payload))
            queued += 2 if isinstance(payload.get("input_ids", [0])[0], list) else 1
        assert server.wait_until(
            lambda: engine.metrics()["engine_waiting_requests"] == queued, DEADLINE_S
        ), engine.metrics()
        for sock in sockets:
            leave(sock)

        assert server.wait_until(
            lambda: engine.metrics()["engine_num_aborted"] == before[ABORTED] + queued,
            DEADLINE_S,
        ), engine.metrics()
        after = scrape(server.url)
        # The holders still ran all along: nothing left the queue but by its abort.
        assert engine.metrics()["engine_running_requests"] == HOLDERS
    assert after[PREFILLED] - before[PREFILLED] == 0
    assert after[by_phase("waiting")] - before[by_phase("waiting")] == queued
    assert after[by_phase("prefill")] == before[by_phase("prefill")]
    assert after["hicache_waiting_requests"] == 0
    # The holders' own aborts (their clients left too) are decode-phase ones.
    assert server.wait_until(
        lambda: engine.metrics()["engine_num_aborted_decode"]
        == before[by_phase("decode")] + HOLDERS, DEADLINE_S,
    )
    assert server.wait_idle(DEADLINE_S)
    engine.check_integrity()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "sse"])
def test_a_running_request_whose_client_leaves_stops_decoding(
    server: RunningServer, stream: bool
) -> None:
    engine = server.engine
    decode_aborts = engine.metrics()["engine_num_aborted_decode"]
    generated = engine.metrics()["engine_num_generated_tokens"]
    payload = {"text": "a long answer, please", "stream": stream,
               "sampling_params": {"max_new_tokens": engine.max_context_len - 64,
                                   "ignore_eos": True}}
    sock = held_request(server.url, "/generate", payload)
    # Decoding: tokens are coming.
    assert server.wait_until(
        lambda: engine.metrics()["engine_num_generated_tokens"] > generated + 4, DEADLINE_S
    )
    leave(sock)
    assert server.wait_until(
        lambda: engine.metrics()["engine_num_aborted_decode"] == decode_aborts + 1, DEADLINE_S
    ), engine.metrics()
    assert server.wait_idle(DEADLINE_S)
    stopped_at = engine.metrics()["engine_num_generated_tokens"]
    assert stopped_at < generated + engine.max_context_len - 64
    assert scrape(server.url)[by_phase("decode")] == decode_aborts + 1
    engine.check_integrity()
