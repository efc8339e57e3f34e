"""A slow tokenization never stalls the server: it runs on a worker thread, not the event loop.

The tiny server's tokenizer is held on purpose: an encode returns only once the
test lets it (as a huge prompt or a slow tokenizer would take its time). While one
request of each route that tokenizes text is inside it, /health must answer, and
the request must then succeed with the ids the tokenizer gives. Were the encode on
the event loop, /health could not answer before the encode returned, which is
never before /health answered: it times out instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

# /health's time while a prompt is held in the tokenizer: generous for a machine busy with
# other work; a loop held by the encode would never answer within it.
HEALTH_BOUND_S = 10.0
# A held encode returns by itself after this long: a guard, never reached when the test
# lets it go.
HOLD_LIMIT_S = 120.0

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
    release = threading.Event()

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        inside.set()
        release.wait(HOLD_LIMIT_S)
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    path, payload = REQUESTS[route]
    responses: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: responses.append(
        httpx.post(f"{server.url}{path}", json=payload, timeout=HOLD_LIMIT_S + 60.0)
    ))
    sender.start()
    try:
        assert inside.wait(60.0), "the request never reached the tokenizer"
        started = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=HEALTH_BOUND_S)
        health_s = time.monotonic() - started
        assert health.status_code == 200
        assert health_s < HEALTH_BOUND_S, f"/health took {health_s:.2f} s during tokenization"
    finally:
        release.set()
        sender.join(60.0)
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
