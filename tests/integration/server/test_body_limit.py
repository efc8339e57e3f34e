"""``--max-request-bytes``: a body over the limit is a 413, refused before it is read.

A real server (tiny engine, uvicorn on a loopback port) with a 64 KiB limit. A
body that declares a larger ``Content-Length`` is answered 413 at once: a client
that sends only the headers (promising ten gigabytes) gets its answer without
sending a byte of body. A chunked body, which declares no length, is counted as
it arrives and refused the same way once over. Neither reaches the engine, and
the client's connection serves its next request. A body under the limit is
served as before.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from hicache.cli import build_parser
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.server_fixtures import RunningServer, serve_in_thread

LIMIT = 64 * 1024
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(max_request_bytes=LIMIT) as running:
        yield running


def _generate_body(text_bytes: int) -> bytes:
    return json.dumps({"text": "a" * text_bytes,
                       "sampling_params": {"max_new_tokens": 1}}).encode()


def _connection(server: RunningServer) -> http.client.HTTPConnection:
    url = urlsplit(server.url)
    return http.client.HTTPConnection(url.hostname or "", url.port, timeout=TIMEOUT_S)


def _assert_refused(status: int, payload: bytes) -> None:
    assert status == 413
    error = json.loads(payload)["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error"
    assert f"at most {LIMIT} bytes" in error["message"]
    assert "--max-request-bytes" in error["message"]


def _count_encodes(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = server.engine.tokenizer.encode

    def counted(text: str, add_special_tokens: bool = True) -> list[int]:
        seen.append(text)
        return real(text, add_special_tokens)

    monkeypatch.setattr(server.engine.tokenizer, "encode", counted)
    return seen


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(
    server: RunningServer,
) -> None:
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nhost: test\r\n"
                     b"content-type: application/json\r\ncontent-length: 10000000000\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, f"the server closed without answering: {answer!r}"
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    _assert_refused(413, payload)


def test_a_large_body_is_refused_and_the_connection_serves_the_next_request(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoded = _count_encodes(server, monkeypatch)
    connection = _connection(server)
    try:
        connection.request("POST", "/generate", _generate_body(LIMIT),
                           {"content-type": "application/json"})
        response = connection.getresponse()
        _assert_refused(response.status, response.read())
        connection.request("GET", "/health")
        follow = connection.getresponse()
        assert follow.status == 200 and json.loads(follow.read())["status"] == "ok"
    finally:
        connection.close()
    assert encoded == []  # the engine never saw it


def test_a_chunked_body_is_counted_as_it_arrives(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoded = _count_encodes(server, monkeypatch)
    body = _generate_body(4 * LIMIT)
    chunks = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    connection = _connection(server)
    try:
        connection.request("POST", "/generate", iter(chunks),
                           {"content-type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        _assert_refused(response.status, response.read())
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    assert encoded == []


def test_a_body_under_the_limit_is_served(server: RunningServer) -> None:
    body = _generate_body(LIMIT - 1024)
    assert len(body) < LIMIT
    response = httpx.post(f"{server.url}/generate", content=body, timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})
    # Far longer than the tiny model's context: the engine's own refusal, not the limit's.
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    small = httpx.post(f"{server.url}/generate", timeout=TIMEOUT_S, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert small.status_code == 200 and small.json()["meta_info"]["completion_tokens"] == 2


def test_the_flag_takes_a_positive_byte_count() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert parser.parse_args(["serve", "--max-request-bytes", "1000"]).max_request_bytes == 1000
    for bad in ("0", "-5", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max-request-bytes", bad])
