"""Bad requests get a 4xx with an OpenAI-style error body that says what is wrong, and
the server keeps serving afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}


# (route, JSON body or raw bytes, expected status, words the message must contain)
CASES: list[tuple[str, Any, int, str]] = [
    # Not JSON / not an object / nothing.
    ("/v1/completions", b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2, 3]", 400, "JSON object"),
    ("/v1/completions", b"", 400, "empty"),
    ("/generate", b"text=hello", 400, "not valid JSON"),
    # Wrong types: refused, not coerced.
    ("/v1/completions", completion(max_tokens="ten"), 400, "max_tokens"),
    ("/v1/completions", completion(max_tokens=4.5), 400, "max_tokens"),
    ("/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("/v1/completions", completion(stream="yes"), 400, "stream"),
    ("/v1/completions", completion(prompt=42), 400, "prompt must be a string or a list"),
    ("/v1/completions", completion(prompt=[1, "two"]), 400, "prompt"),
    ("/v1/completions", completion(stop=7), 400, "stop must be a string"),
    ("/v1/chat/completions", chat(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 3}]), 400, "content"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "4"}}, 400,
     "max_new_tokens"),
    # Unknown fields (a misspelt parameter is never silently ignored).
    ("/v1/completions", completion(max_token=4), 400, "unrecognized field 'max_token'"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 4}}, 400,
     "unrecognized field 'sampling_params.max_tokens'"),
    # Invalid values.
    ("/v1/completions", completion(temperature=-1), 400, "temperature"),
    ("/v1/completions", completion(top_p=0), 400, "top_p"),
    ("/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("/v1/completions", completion(top_k=-7), 400, "top_k"),
    ("/v1/completions", completion(seed=-1), 400, "seed"),
    ("/v1/completions", completion(stop=[""]), 400, "stop"),
    ("/v1/completions", completion(n=0), 400, "n must be in"),
    ("/v1/completions", completion(best_of=3), 400, "best_of=3"),
    ("/v1/completions", completion(prompt=["a", ["b"]]), 400, "prompt must be"),
    ("/v1/completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "role"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("/generate", {"sampling_params": {}}, 400, "exactly one of text and input_ids"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one of text and input_ids"),
    # Lengths: negative, zero, huge, longer than the context.
    ("/v1/completions", completion(max_tokens=-1), 400, "max_tokens"),
    # Sampling and logprob options out of range.
    ("/v1/completions", completion(max_tokens=2, min_tokens=3), 400, "min_new_tokens"),
    ("/v1/completions", completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", completion(presence_penalty=2.5), 400, "presence_penalty"),
    ("/v1/completions", completion(logprobs=50), 400, "logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs needs logprobs"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3}, 400,
     "logprob_start_len"),
    ("/v1/completions", completion(max_tokens=10**12), 400, "context"),
    ("/v1/chat/completions", chat(max_completion_tokens=10**6), 400, "context"),
    ("/v1/completions", completion(prompt=[65] * 5000), 400, "context"),
    ("/generate", {"input_ids": [65] * 5000}, 400, "context"),
    # Token ids outside the vocabulary.
    ("/v1/completions", completion(prompt=[1, 2, 100000]), 400, "vocabulary"),
    ("/v1/completions", completion(prompt=[-1]), 400, "vocabulary"),
    ("/generate", {"input_ids": [5, 1 << 40]}, 400, "vocabulary"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [99999]}}, 400,
     "stop_token_ids"),
    # Empty prompts.
    ("/v1/completions", completion(prompt=""), 400, "empty"),
    ("/v1/completions", completion(prompt=[]), 400, "empty"),
    ("/generate", {"text": ""}, 400, "empty"),
    ("/generate", {"input_ids": []}, 400, "empty"),
]


@pytest.mark.parametrize(("route", "body", "status", "words"), CASES)
def test_bad_request_is_refused_clearly(
    client: httpx.Client, route: str, body: Any, status: int, words: str
) -> None:
    if isinstance(body, bytes):
        response = client.post(route, content=body,
                               headers={"Content-Type": "application/json"})
    else:
        response = client.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error["message"]
    assert error["code"] == status
    assert error["type"].endswith("_error")


def test_wrong_method_and_route(client: httpx.Client) -> None:
    wrong_method = client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert "error" in wrong_method.json()
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"


def test_still_serving_after_bad_requests(client: httpx.Client, server: RunningServer) -> None:
    for route, body, status, _ in CASES:
        if not isinstance(body, bytes):
            assert client.post(route, json=body).status_code == status
    good = client.post("/v1/completions", json=completion(max_tokens=3, ignore_eos=True))
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 3
    generated = client.post("/generate", json={"input_ids": [1, 2, 3],
                                               "sampling_params": {"max_new_tokens": 2}})
    assert generated.status_code == 200
    # Nothing a refused request touched was left behind.
    assert server.wait_idle()
    server.engine.check_integrity()
    assert server.engine.metrics()["engine_num_aborted"] == 0
