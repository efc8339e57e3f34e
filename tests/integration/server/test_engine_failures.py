"""What clients see when the engine fails a request it had accepted, or is not running:
a stand-in engine (the real one only fails on faults) behind the real app and uvicorn."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from hicache.engine.api import CachedTokens, GenerateOutput, GenerateRequest, RequestError
from hicache.server.app import create_app
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.server_fixtures import serve_app_in_thread


class FailingEngine:
    """Accepts a request, streams one token, then fails it as the engine does on a fault."""

    model_name = "failing"
    vocab_size = 256
    max_context_len = 64
    tokenizer = ByteTokenizer()

    def __init__(self) -> None:
        self.running = True
        self.streams_closed = 0

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenize("".join(str(m.get("content", "")) for m in messages))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if not self.running:
            raise RuntimeError("the engine is not running")
        if not request.input_ids:
            raise RequestError("the prompt is empty")
        n = len(request.input_ids)
        try:
            yield GenerateOutput("r", (65,), "A", False, None, n, 1, CachedTokens())
            yield GenerateOutput("r", (), "", True, "abort", n, 1, CachedTokens(),
                                 error="device lost")
        finally:
            self.streams_closed += 1

    def abort(self, rid: str) -> None:
        pass

    def flush_cache(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {"engine_num_prompt_tokens": 3.0, "brand_new_gauge": 7.0,
                "engine_num_brand_new_things": 2.0, "storage_failures_timeout": 4.0,
                "storage_backend_failures_corrupt": 5.0}

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        pass

    def detach_storage(self) -> None:
        pass

    def storage_status(self) -> dict[str, Any]:
        return {"attached": False, "error": None}


@pytest.fixture(scope="module")
def engine() -> FailingEngine:
    return FailingEngine()


@pytest.fixture(scope="module")
def client(engine: FailingEngine) -> Iterator[httpx.Client]:
    with serve_app_in_thread(create_app(engine)) as url, httpx.Client(
        base_url=url, timeout=30.0
    ) as http:
        yield http


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"text": "abc"}),
        ("/v1/completions", {"prompt": "abc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
    ],
)
def test_failed_request_is_a_500_with_the_reason(
    client: httpx.Client, engine: FailingEngine, route: str, body: dict[str, Any]
) -> None:
    closed = engine.streams_closed
    response = client.post(route, json=body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert "device lost" in error["message"] and error["type"] == "server_error"
    assert engine.streams_closed == closed + 1


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"text": "abc", "stream": True}),
        ("/v1/completions", {"prompt": "abc", "stream": True}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "abc"}], "stream": True}),
    ],
)
def test_failed_stream_ends_with_an_error_event(
    client: httpx.Client, engine: FailingEngine, route: str, body: dict[str, Any]
) -> None:
    closed = engine.streams_closed
    with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "device lost" in last["error"]["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert engine.streams_closed == closed + 1


def test_refused_and_stopped_engine(client: httpx.Client, engine: FailingEngine) -> None:
    assert client.post("/generate", json={"input_ids": []}).status_code == 400
    engine.running = False
    try:
        stopped = client.post("/generate", json={"text": "abc"})
        assert stopped.status_code == 503
        assert "not running" in stopped.json()["error"]["message"]
    finally:
        engine.running = True


def test_unknown_engine_numbers_are_still_exported(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    assert "hicache_brand_new_gauge 7.0" in text
    assert "hicache_engine_brand_new_things_total 2.0" in text
    # One family for the controller's reasons and the backend's, told apart by source.
    assert 'hicache_l3_failures_total{reason="timeout",source="controller"} 4.0' in text
    assert 'hicache_l3_failures_total{reason="corrupt",source="backend"} 5.0' in text
    assert text.count("# TYPE hicache_l3_failures_total counter") == 1
    assert "hicache_prompt_tokens_total 3.0" in text
