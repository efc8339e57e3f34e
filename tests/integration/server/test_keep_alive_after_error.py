"""A 500 leaves the client's keep-alive connection usable for its next request.

A real server (tiny engine, uvicorn on a loopback port) and one
``http.client.HTTPConnection``, reused for every request as a pooling client
would. A request fails two ways: the engine fails it mid-generation (its
detokenizer raises), and a bug in the route's own code raises (the tokenizer
raises an unexpected exception). Each is a 500 in the server's error shape with
the traceback in the server's log, and the next request on the same connection
succeeds. Before, a bug's 500 was followed by uvicorn closing the connection,
and the client's next request on it failed with a reset.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

import hicache.engine.engine as engine_module
from tests.integration.engine.test_engine_request_faults import _FailingDetokenizer
from tests.server_fixtures import RunningServer, serve_in_thread

FAILING_IDS = [7 + i % 50 for i in range(40)]
TIMEOUT_S = 60.0


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningServer]:
    monkeypatch.setattr(_FailingDetokenizer, "failing_prompt", tuple(FAILING_IDS))
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", _FailingDetokenizer)
    with serve_in_thread() as running:
        yield running


def _post(connection: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[int, Any]:
    connection.request("POST", "/generate", json.dumps(body),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def _generate_ok(connection: http.client.HTTPConnection) -> None:
    status, answer = _post(connection, {
        "text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert status == 200, answer
    assert answer["meta_info"]["completion_tokens"] == 2


def test_the_connection_outlives_a_500(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=TIMEOUT_S)
    try:
        _generate_ok(connection)
        status, answer = _post(connection, {
            # ignore_eos: a sampled end of sequence before the fourth token would end the
            # request before the detokenizer fails it.
            "input_ids": FAILING_IDS,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert status == 500 and "next token" in answer["error"]["message"]
        _generate_ok(connection)

        def broken(text: str, add_special_tokens: bool = True) -> list[int]:
            raise ZeroDivisionError("a bug in the route")

        monkeypatch.setattr(server.engine.tokenizer, "encode", broken)
        with caplog.at_level(logging.ERROR, logger="hicache.server.errors"):
            status, answer = _post(connection, {"text": "hello"})
        assert status == 500
        assert answer["error"]["type"] == "server_error"
        assert "ZeroDivisionError: a bug in the route" in answer["error"]["message"]
        connection.request("GET", "/health")  # the same connection
        health = connection.getresponse()
        assert health.status == 200 and json.loads(health.read())["status"] == "ok"
    finally:
        connection.close()
    logged = [r for r in caplog.records if "unhandled error in POST /generate" in r.message]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log
    assert server.wait_idle()
