"""The access log: one line per HTTP request at info level (method, path, status, latency,
prompt/cached/output tokens, rid), never the prompt's text; polled routes at debug level;
none with ``access_log=False`` (``--disable-access-log``)."""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from hicache.server.app import create_app
from hicache.server.serve import add_arguments
from tests.server_fixtures import (
    WAIT_S,
    RunningServer,
    build_test_engine,
    serve_app_in_thread,
    serve_in_thread,
)
from tests.waiting import wait_until

MODEL = "tiny-test-model"
SECRET = "a prompt whose text must never reach the log"
LINE = re.compile(r"^(\S+) (\S+) (\d{3}) ([\d.]+)ms prompt=(\d+) cached=(\d+) output=(\d+) "
                  r"tenant=(\S+) rid=(.+)$")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(served_model_name=MODEL) as running:
        yield running


def access_lines(caplog: pytest.LogCaptureFixture, path: str, count: int = 1
                 ) -> list[logging.LogRecord]:
    """The access log's records for ``path``, once ``count`` of them were written (the line
    is written after the response was sent, so it may come a moment after the answer)."""
    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "hicache.access"
                and r.getMessage().split(" ")[1:2] == [path]]

    wait_until(lambda: len(records()) >= count, WAIT_S)  # the caller asserts on what came
    return records()


def test_a_line_per_request_with_its_tokens(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache.access")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SECRET}], max_tokens=3, n=2,
            extra_body={"rid": "access-log-chat", "ignore_eos": True},
        )
        assert reply.usage is not None
        [record] = access_lines(caplog, "/v1/chat/completions")
        assert record.levelno == logging.INFO
        match = LINE.match(record.getMessage())
        assert match is not None, record.getMessage()
        method, _, status, ms, prompt, cached, output, tenant, rid = match.groups()
        assert tenant == "default"
        assert (method, status) == ("POST", "200") and float(ms) > 0
        # Each of the two samples counts its prompt (the second found it cached).
        assert int(prompt) == 2 * reply.usage.prompt_tokens
        assert int(output) == reply.usage.completion_tokens == 6
        assert int(cached) >= 1
        assert rid == "access-log-chat-0 (+1 more)"

        # Streamed: the line comes when the stream ended, with its tokens; a salt nested in
        # a tenant is logged as that tenant, never as the salt.
        chunks = list(client.completions.create(
            model=MODEL, prompt=SECRET, max_tokens=4, stream=True,
            extra_body={"rid": "access-log-stream", "ignore_eos": True,
                        "cache_salt": "acme", "extra_key": "private-salt"},
        ))
        assert chunks
        [record] = access_lines(caplog, "/v1/completions")
        match = LINE.match(record.getMessage())
        assert match is not None
        assert match.group(7) == "4" and match.group(9) == "access-log-stream"
        assert match.group(8) == "acme" and "private-salt" not in record.getMessage()

    # Refusals and unknown routes are logged too, with no tokens.
    httpx.post(f"{server.url}/v1/completions", json={"prompt": ""}, timeout=30.0)
    records = access_lines(caplog, "/v1/completions", count=2)
    assert records[-1].getMessage().startswith("POST /v1/completions 400 ")
    assert records[-1].getMessage().endswith("prompt=0 cached=0 output=0 tenant=- rid=-")
    httpx.get(f"{server.url}/v2/nothing", timeout=30.0)
    [record] = access_lines(caplog, "/v2/nothing")
    assert record.getMessage().startswith("GET /v2/nothing 404 ")
    # Probes: debug level.
    httpx.get(f"{server.url}/health", timeout=30.0)
    [record] = access_lines(caplog, "/health")
    assert record.levelno == logging.DEBUG
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_no_line_when_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache.access")
    engine = build_test_engine()
    try:
        with serve_app_in_thread(create_app(engine, access_log=False)) as url:
            answer = httpx.post(f"{url}/generate", timeout=60.0,
                                json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            assert answer.status_code == 200
    finally:
        engine.shutdown()
    # The server has stopped: any line it would write has been written.
    assert [r for r in caplog.records if r.name == "hicache.access"] == []


def test_the_serve_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).disable_access_log is False
    assert parser.parse_args(["--disable-access-log"]).disable_access_log is True
