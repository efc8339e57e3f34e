"""SGLang's native utility endpoints on a real server (the tiny model, its byte tokenizer):
/tokenize and /detokenize, /health_generate, /abort_request, and /generate by PUT."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.server import native_api
from tests.server_fixtures import RunningServer, serve_in_thread

BOS = 256  # the byte tokenizer's <|bos|>


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_one_text_or_many(
    client: httpx.Client, server: RunningServer, path: str
) -> None:
    one = client.post(path, json={"prompt": "hi"}).json()
    assert one == {"tokens": [BOS, 104, 105], "count": 3,
                   "max_model_len": server.engine.max_context_len}
    plain = client.post(path, json={"prompt": ["hi", "h<|user|>"],
                                    "add_special_tokens": False}).json()
    assert plain["tokens"] == [[104, 105], [104, 259]] and plain["count"] == [2, 2]


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_round_trips_tokenize(client: httpx.Client, path: str) -> None:
    text = "pages, héllo"
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert client.post(path, json={"tokens": ids}).json() == {"text": text}
    kept = client.post(path, json={"tokens": [ids, [BOS]], "skip_special_tokens": False})
    assert kept.json() == {"text": [f"<|bos|>{text}", "<|bos|>"]}
    assert client.post(path, json={"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize("path, body, status, says", [
    ("/detokenize", {"tokens": [1, 99999]}, 400, "out of the vocabulary"),
    ("/detokenize", {"tokens": [[1], [-1]]}, 400, "out of the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_token": True}, 400, "add_special_token"),
    ("/abort_request", {}, 400, "abort_all"),
])
def test_bad_requests_are_refused_clearly(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, says: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    assert says in response.text


def test_health_generate_runs_a_token(client: httpx.Client, server: RunningServer) -> None:
    before = server.engine.metrics()["engine_num_generated_tokens"]
    response = client.get("/health_generate")
    assert response.status_code == 200 and response.json() == {"healthy": True}
    assert server.engine.metrics()["engine_num_generated_tokens"] == before + 1
    assert server.wait_idle()
    server.engine.check_integrity()


def test_health_generate_fails_when_no_token_comes_in_time(
    client: httpx.Client, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_api, "HEALTH_GENERATE_TIMEOUT_S", 0.0)
    response = client.get("/health_generate")
    assert response.status_code == 503 and response.json()["healthy"] is False
    assert server.wait_idle()  # the probe was dropped, not left running
    server.engine.check_integrity()


def _stream_until_aborted(server: RunningServer, rid: str, started: threading.Event,
                          result: dict[str, Any]) -> None:
    body = {"text": "go on", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": server.engine.max_context_len - 64,
                                "ignore_eos": True}}
    with httpx.Client(timeout=60.0) as http, http.stream(
        "POST", f"{server.url}/generate", json=body
    ) as response:
        last: dict[str, Any] = {}
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
                started.set()
        result["last"] = last


@pytest.mark.parametrize("how", ["rid", "abort_all"])
def test_abort_request_ends_a_running_request(
    client: httpx.Client, server: RunningServer, how: str
) -> None:
    rid = f"to-abort-{how}"
    started, result = threading.Event(), {}
    streamer = threading.Thread(target=_stream_until_aborted,
                                args=(server, rid, started, result))
    streamer.start()
    try:
        assert started.wait(30), "the request never started streaming"
        assert client.post("/abort_request", json={"rid": "not-running"}).status_code == 200
        assert not server.engine.is_idle()  # an unknown rid aborted nothing
        body = {"rid": rid} if how == "rid" else {"abort_all": True}
        assert client.post("/abort_request", json=body).status_code == 200
        streamer.join(30)
        assert not streamer.is_alive(), "the aborted stream did not end"
    finally:
        if streamer.is_alive():
            client.post("/abort_request", json={"abort_all": True})
            streamer.join(30)
    assert result["last"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.wait_idle()
    server.engine.check_integrity()


def test_generate_answers_put_as_post(client: httpx.Client) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                        "ignore_eos": True}}
    put = client.put("/generate", json=body)
    assert put.status_code == 200, put.text
    assert put.json()["output_ids"] == client.post("/generate", json=body).json()["output_ids"]
