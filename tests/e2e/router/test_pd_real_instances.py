"""The PD router in front of a real prefill and decode ``hicache serve`` pair (child
processes, Mooncake TransferEngine over loopback): greedy answers through the router
equal a plain server's, streamed or not, on every routed endpoint, and both instances
end clean (check_integrity)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.settings import PrefillEndpoint
from hicache.testing.server_process import ServerProcess
from tests.dev_dependency import require_dev_dependency
from tests.router_fixtures import RunningRouter, running_pd_router
from tests.waiting import wait_until

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")
pd_fixtures = pytest.importorskip(
    "tests.pd_fixtures", reason="the engine side of prefill-decode disaggregation is not here")

ARGS = ["--device", "cpu", "--max-total-tokens", "2048", "--model-preset", "tiny",
        "--page-size", "16"]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[tuple[ServerProcess, Any, RunningRouter]]:
    logs = tmp_path_factory.mktemp("pd-router-logs")
    env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path_factory.mktemp("pd-cache"))}
    with ExitStack() as stack:
        plain = pd_fixtures.plain_server(ARGS, logs / "plain.log", env=env)
        stack.callback(plain.stop)
        plain.launch()
        pair = stack.enter_context(pd_fixtures.pd_pair(ARGS, logs, env=env))
        plain.wait_ready()
        index = PageIndex()
        policy = build_policy("cache_aware", index, None, ScoringConfig())
        router = stack.enter_context(running_pd_router(
            [PrefillEndpoint(pair.prefill.url, pair.bootstrap_port)], [pair.decode.url],
            policy=policy, index=index, request_timeout_s=TIMEOUT_S))
        yield plain, pair, router


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(length)]


def test_greedy_answers_through_the_router_equal_a_plain_servers(
    deployment: tuple[ServerProcess, Any, RunningRouter],
) -> None:
    plain, pair, router = deployment
    for length in (5, 16, 40):
        body = {"input_ids": _prompt(length, length), "sampling_params": {
            "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
        expected = httpx.post(f"{plain.url}/generate", json=body, timeout=TIMEOUT_S).json()
        response = router.post("/generate", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == expected["output_ids"]
    completion = {"prompt": _prompt(30, 7), "max_tokens": 8, "temperature": 0}
    expected_text = httpx.post(f"{plain.url}/v1/completions", json=completion,
                               timeout=TIMEOUT_S).json()["choices"][0]["text"]
    answer = router.post("/v1/completions", json=completion, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected_text
    streamed = ""
    with httpx.stream("POST", f"{router.url}/v1/completions",
                      json={**completion, "stream": True}, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    assert streamed == expected_text
    chat = {"messages": [{"role": "user", "content": "a page table maps"}], "max_tokens": 6,
            "temperature": 0}
    expected_chat = httpx.post(f"{plain.url}/v1/chat/completions", json=chat,
                               timeout=TIMEOUT_S).json()["choices"][0]["message"]["content"]
    answer = router.post("/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected_chat
    for server in (pair.prefill, pair.decode):
        pd_fixtures.check_integrity(server)


def test_a_client_that_leaves_mid_stream_leaves_both_instances_clean(
    deployment: tuple[ServerProcess, Any, RunningRouter],
) -> None:
    _, pair, router = deployment
    body = {"input_ids": _prompt(50, 3), "stream": True, "sampling_params": {
        "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{router.url}/generate", json=body,
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert "output_ids" in first or "text" in first
    # The decode instance aborts the request (its client, the router, left); then both
    # instances are idle and consistent.
    for server in (pair.prefill, pair.decode):
        _until_clean(server)
    assert _aborted(pair.decode) >= 1
    # And the pair still serves.
    again = router.post("/generate", json={**body, "stream": False, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}}, timeout=TIMEOUT_S)
    assert again.status_code == 200, again.text


def _until_clean(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """check-integrity once the server is idle (it answers 409 while requests run)."""
    response: httpx.Response | None = None

    def not_busy() -> bool:
        nonlocal response
        response = httpx.post(f"{server.url}/hicache/check-integrity", timeout=TIMEOUT_S,
                              headers={"Authorization": f"Bearer {pd_fixtures.ADMIN_KEY}"})
        return response.status_code != 409

    wait_until(not_busy, timeout_s, poll_s=0.2)  # a 409 left is reported just below
    assert response is not None
    assert response.status_code == 200, response.text


def _aborted(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hicache_requests_aborted_total"))
