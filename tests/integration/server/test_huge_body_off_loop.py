"""A huge request never holds the event loop: /health keeps answering while it is processed.

A real server with SmolLM2's own tokenizer (a ``tokenizers`` BPE with special
tokens, the kind whose single-text encode held the interpreter lock for seconds on
a megabytes-long prompt, so that the server's event loop could not run even with
the encode on a worker thread) is sent a ~10 MB chat body of 5,000 messages full
of special-token strings, and a ~10 MB /generate prompt. A poller asks /health
over and over meanwhile. Event-based, not timed: the tokenizer is wrapped to mark
when its encode of the big prompt starts and ends, and /health must have answered
several times in between; a held loop answers nothing in between (at most a
poll at each edge). The request itself ends in the engine's clear 400 (the prompt
is far longer than the context). The latencies seen are printed (``-s``).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from hicache.model.gguf_cache import ConvertedModel
from tests.server_fixtures import RunningServer, serve_in_thread

# Answers of /health needed while the big prompt is being encoded; a loop held by the
# encode gives none but at the edges (a poll that raced its start or its end).
MIN_ANSWERS_DURING = 5
BIG_TEXT_CHARS = 10 * 2**20
REQUEST_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(smollm2: ConvertedModel) -> Iterator[RunningServer]:
    with serve_in_thread(["--model-path", str(smollm2.path)]) as running:
        yield running


def _chat_body() -> bytes:
    content = "<|im_start|>user\n" + "<|im_end|><|im_start|>" * 96
    body = {"messages": [{"role": "user", "content": content}] * 5000, "max_tokens": 1}
    return json.dumps(body).encode()


def _generate_body() -> bytes:
    text = "<|im_start|>hello world " * (BIG_TEXT_CHARS // 24)
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()


BODIES = {"chat": ("/v1/chat/completions", _chat_body), "generate": ("/generate", _generate_body)}


@pytest.mark.parametrize("kind", list(BODIES))
def test_health_answers_while_a_huge_body_is_tokenized(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path, make_body = BODIES[kind]
    body = make_body()
    assert len(body) > 9 * 2**20
    tokenizer = server.engine.tokenizer
    real_encode = tokenizer.encode
    encoding = threading.Event()  # set while the big prompt is in the tokenizer
    encoded = threading.Event()

    def marked_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        big = len(text) > 2**20
        if big:
            encoding.set()
        try:
            return real_encode(text, add_special_tokens)
        finally:
            if big:
                encoding.clear()
                encoded.set()

    monkeypatch.setattr(tokenizer, "encode", marked_encode)
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.url}{path}", content=body, timeout=REQUEST_TIMEOUT_S,
        headers={"content-type": "application/json"})))
    latencies_ms: list[float] = []
    during = 0
    sender.start()
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        while sender.is_alive():
            started = time.monotonic()
            health = client.get("/health")
            latencies_ms.append((time.monotonic() - started) * 1000)
            assert health.status_code == 200
            during += encoding.is_set()
    sender.join()
    (answer,) = answers
    assert answer.status_code == 400, answer.text
    assert "context" in answer.json()["error"]["message"]
    assert encoded.is_set(), "the big prompt never reached the tokenizer"
    print(f"\n{kind}: {len(body) / 1e6:.1f} MB; /health answered {len(latencies_ms)} times "
          f"({during} while the prompt was encoded): max {max(latencies_ms):.0f} ms, "
          f"p50 {statistics.median(latencies_ms):.0f} ms")
    assert during >= MIN_ANSWERS_DURING, (
        f"/health answered {during} times while the prompt was encoded: the event loop "
        "was held")
    assert server.wait_idle()
