"""Through the PD router, in front of a real prefill and decode ``hicache serve`` pair (child
processes, Mooncake over loopback): a client that leaves while its request waits in the
prefill instance's queue drops it on both instances, and the prefill instance computes
none of its prompt; a client that leaves mid-stream stops the decode instance's decoding.

The prefill instance's one running slot (``--max-running-requests 1``) is held by long
prompts prefilled in small chunks; the abandoned requests queue behind them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from hicache.router.settings import PrefillEndpoint
from hicache.testing.server_process import ServerProcess
from tests.abandoned_clients import held_request, leave, long_prompt, sample, scrape
from tests.dev_dependency import require_dev_dependency
from tests.router_fixtures import RunningRouter, running_pd_router
from tests.waiting import wait_until

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")
pd_fixtures = pytest.importorskip(
    "tests.pd_fixtures", reason="the engine side of prefill-decode disaggregation is not here")

ARGS = ["--device", "cpu", "--max-total-tokens", "40000", "--model-preset", "tiny",
        "--page-size", "16"]
# Each holder's prompt takes the prefill instance hundreds of steps (seconds).
PREFILL_ARGS = ["--max-running-requests", "1", "--chunked-prefill-size", "16"]
HOLDERS = 3
HOLDER_TOKENS = 8000
ABANDONED = 4
PROMPT_TOKENS = 1500
DEADLINE_S = 120.0  # bounds a failing test only: every wait is for an event
ABORTED_BY_PHASE = "hicache_requests_aborted_by_phase_total"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, RunningRouter]]:
    logs = tmp_path_factory.mktemp("pd-disconnect-logs")
    env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path_factory.mktemp("pd-cache"))}
    with ExitStack() as stack:
        pair = stack.enter_context(pd_fixtures.pd_pair(ARGS, logs, env=env,
                                                       prefill_args=PREFILL_ARGS))
        router = stack.enter_context(running_pd_router(
            [PrefillEndpoint(pair.prefill.url, pair.bootstrap_port)], [pair.decode.url],
            request_timeout_s=DEADLINE_S))
        yield pair, router


def _requests(server: ServerProcess) -> float:
    return scrape(server.url)["hicache_requests_total"]


def test_clients_that_leave_while_queued_cost_the_prefill_instance_no_prefill(
    deployment: tuple[Any, RunningRouter],
) -> None:
    pair, router = deployment
    prefill, decode = pair.prefill, pair.decode
    before, decode_before = scrape(prefill.url), scrape(decode.url)
    accepted = before["hicache_requests_total"]
    with ThreadPoolExecutor(HOLDERS) as pool:
        holders = [pool.submit(httpx.post, f"{router.url}/generate", timeout=DEADLINE_S, json={
            "input_ids": long_prompt(1000 + i, HOLDER_TOKENS),
            "sampling_params": {"max_new_tokens": 1}}) for i in range(HOLDERS)]
        assert wait_until(lambda: _requests(prefill) == accepted + HOLDERS, DEADLINE_S)
        sockets = [held_request(router.url, "/generate", {
            "input_ids": long_prompt(i, PROMPT_TOKENS), "stream": i % 2 == 0,
            "sampling_params": {"max_new_tokens": 4}}) for i in range(ABANDONED)]
        # Every abandoned request reached the prefill instance (queued behind the holders).
        assert wait_until(lambda: _requests(prefill) == accepted + HOLDERS + ABANDONED,
                        DEADLINE_S)
        for sock in sockets:
            leave(sock)
        waiting_aborts = sample(before, ABORTED_BY_PHASE, phase="waiting") + ABANDONED
        assert wait_until(lambda: sample(scrape(prefill.url), ABORTED_BY_PHASE, phase="waiting")
                        == waiting_aborts, DEADLINE_S), scrape(prefill.url)
        for holder in holders:
            answer = holder.result()
            assert answer.status_code == 200, answer.text
    after = scrape(prefill.url)
    # The holders' prompts, and not one token of the abandoned ones.
    computed = after["hicache_prefill_step_tokens_total"] - \
        before["hicache_prefill_step_tokens_total"]
    assert computed == HOLDERS * HOLDER_TOKENS
    # The decode instance dropped its side of each too (they never joined its batch).
    assert wait_until(lambda: scrape(decode.url)["hicache_requests_aborted_total"]
                    == decode_before["hicache_requests_aborted_total"] + ABANDONED, DEADLINE_S)
    assert sample(scrape(router.url), "router_client_disconnects_total",
                  stage="before_answer") >= ABANDONED
    for server in (prefill, decode):
        _until_clean(server)


def test_a_client_that_leaves_mid_stream_stops_the_decoding(
    deployment: tuple[Any, RunningRouter],
) -> None:
    pair, router = deployment
    decode = pair.decode
    aborted = sample(scrape(decode.url), ABORTED_BY_PHASE, phase="decode")
    body = {"input_ids": long_prompt(7, 40), "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with httpx.stream("POST", f"{router.url}/generate", json=body,
                      timeout=DEADLINE_S) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    assert wait_until(lambda: sample(scrape(decode.url), ABORTED_BY_PHASE, phase="decode")
                    == aborted + 1, DEADLINE_S)
    assert sample(scrape(router.url), "router_client_disconnects_total",
                  stage="answering") >= 1
    for server in (pair.prefill, decode):
        _until_clean(server)


def _until_clean(server: ServerProcess) -> None:
    """check-integrity once the server is idle (it answers 409 while requests run)."""
    def clean() -> bool:
        response = httpx.post(f"{server.url}/hicache/check-integrity", timeout=DEADLINE_S,
                              headers={"Authorization": f"Bearer {pd_fixtures.ADMIN_KEY}"})
        assert response.status_code in (200, 409), response.text
        return response.status_code == 200

    assert wait_until(clean, DEADLINE_S)
