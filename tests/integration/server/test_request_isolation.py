"""Over HTTP: a request the engine fails mid-generation is a 500 for that client alone.

A real server (tiny engine, uvicorn on a loopback port): while one client
streams a long answer, another's request fails in its detokenizer and a third
asks for a temperature too small to divide by. The failing one gets a 500 with
the reason, the tiny temperature gets the greedy answer, and the stream goes
on to the end untouched.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import hicache.engine.engine as engine_module
from tests.integration.engine.test_engine_request_faults import _FailingDetokenizer
from tests.server_fixtures import serve_in_thread

TIMEOUT = httpx.Timeout(30.0)
STREAM_TOKENS = 200


def sampling(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def test_a_failing_request_is_a_500_for_it_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    failing_ids = [7 + i % 50 for i in range(40)]
    monkeypatch.setattr(_FailingDetokenizer, "failing_prompt", tuple(failing_ids))
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", _FailingDetokenizer)
    with serve_in_thread() as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        stream_body = {"input_ids": list(range(60, 100)), "stream": True,
                       "sampling_params": sampling(STREAM_TOKENS)}
        with http.stream("POST", "/generate", json=stream_body) as stream:
            assert stream.status_code == 200
            lines = (line for line in stream.iter_lines() if line)
            assert next(lines).startswith("data: {")  # it runs

            failed = http.post("/generate", json={"input_ids": failing_ids,
                                                  "sampling_params": sampling(16)})
            assert failed.status_code == 500
            assert "next token" in failed.json()["error"]["message"]

            other = list(range(120, 150))
            tiny = http.post("/generate", json={
                "input_ids": other, "sampling_params": sampling(12, temperature=1e-40)})
            greedy = http.post("/generate", json={
                "input_ids": other, "sampling_params": sampling(12)})
            assert tiny.status_code == 200 and greedy.status_code == 200, tiny.text
            assert tiny.json()["output_ids"] == greedy.json()["output_ids"]

            events = [line.removeprefix("data: ") for line in lines]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "error" not in last, last
        assert len(last["output_ids"]) == STREAM_TOKENS
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": STREAM_TOKENS}
        assert server.wait_idle()
        server.engine.check_integrity()
