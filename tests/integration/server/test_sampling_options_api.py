"""max_new_tokens 0, min_new_tokens / min_tokens and the penalties over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

PROMPT = "Warm the cache with this prompt before the conversation goes on. " * 2


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


def post(server: RunningServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}{route}", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_zero_new_tokens_warms_the_cache(server: RunningServer) -> None:
    warm = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert warm["text"] == "" and warm["output_ids"] == []
    assert warm["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert warm["meta_info"]["completion_tokens"] == 0
    prompt_tokens = warm["meta_info"]["prompt_tokens"]
    again = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert again["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16 > 0
    assert server.wait_idle()
    server.engine.check_integrity()


def test_min_tokens_holds_back_the_stop_token(server: RunningServer) -> None:
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ids = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})["output_ids"]
    stopped = post(server, "/v1/completions", {**base, "stop_token_ids": [ids[0]]})
    assert stopped["usage"]["completion_tokens"] == 1
    held = post(server, "/v1/completions", {**base, "stop_token_ids": [ids[0]], "min_tokens": 3})
    assert held["usage"]["completion_tokens"] >= 3
    sglang = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [ids[0]],
        "min_new_tokens": 3}})
    assert len(sglang["output_ids"]) >= 3 and ids[0] not in sglang["output_ids"][:3]


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
])
def test_greedy_penalties_are_deterministic_and_change_the_answer(
    server: RunningServer, penalty: dict[str, float]
) -> None:
    sampling = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/generate", {"text": PROMPT, "sampling_params": sampling})
    body = {"text": PROMPT, "sampling_params": {**sampling, **penalty}}
    first, second = post(server, "/generate", body), post(server, "/generate", body)
    assert first["output_ids"] == second["output_ids"]
    assert first["output_ids"] != plain["output_ids"]
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0,
        **penalty,
    })
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
