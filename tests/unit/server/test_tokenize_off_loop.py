"""A slow tokenization never stalls the server: it runs on a worker thread, not the event loop.

The tiny server's tokenizer is slowed on purpose (2 s per encode, as a huge
prompt or a slow tokenizer would take). While one request of each route that
tokenizes text is inside it, /health must answer within a second, and the
request must still succeed with the ids the tokenizer gives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

SLOW_TOKENIZE_S = 2.0
HEALTH_BOUND_S = 1.0

GREEDY = {"temperature": 0, "max_tokens": 4}
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/generate", {
        "text": "hello there",
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }),
    "completions": ("/v1/completions", {"prompt": "hello there", **GREEDY}),
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello there"}], **GREEDY,
    }),
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


@pytest.mark.parametrize("route", list(REQUESTS))
def test_health_answers_while_a_prompt_is_tokenized(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    tokenizer = server.engine.tokenizer
    real_encode = tokenizer.encode
    inside = threading.Event()

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        inside.set()
        time.sleep(SLOW_TOKENIZE_S)
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    path, payload = REQUESTS[route]
    responses: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: responses.append(
        httpx.post(f"{server.url}{path}", json=payload, timeout=30.0)
    ))
    sender.start()
    try:
        assert inside.wait(10.0), "the request never reached the tokenizer"
        started = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=10.0)
        health_s = time.monotonic() - started
        assert health.status_code == 200
        assert health_s < HEALTH_BOUND_S, f"/health took {health_s:.2f} s during tokenization"
    finally:
        sender.join(30.0)
    (response,) = responses
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["meta_info"] if route == "generate" else body["usage"]
    assert usage["completion_tokens"] > 0
    assert server.wait_idle()


def test_a_chat_the_tokenizer_refuses_is_still_a_400(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=10.0, json={
        "messages": [{"role": "robot", "content": "hi"}], "max_tokens": 2,
    })
    assert response.status_code == 400
    assert "role" in response.json()["error"]["message"]
