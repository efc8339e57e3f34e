"""What the router takes for a draining worker: only the drain contract's answers, never
a 503 alone (an overloaded worker's 503 is a failure, not a drain)."""

from __future__ import annotations

import json

import httpx
import pytest

from hicache.router.drain import is_draining_health, is_draining_refusal, says_retry_now


def error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error",
                                 "code": 503}}).encode()


@pytest.mark.parametrize(("status", "body", "draining"), [
    (503, {"status": "draining"}, True),
    (503, {"status": "unavailable"}, False),
    (503, ["draining"], False),
    (200, {"status": "draining"}, False),
    (200, {}, False),
])
def test_health_is_draining_only_as_a_503_saying_so(status: int, body: object,
                                                     draining: bool) -> None:
    assert is_draining_health(httpx.Response(status, json=body)) is draining


def test_health_that_is_not_json_is_not_draining() -> None:
    assert not is_draining_health(httpx.Response(503, content=b"draining"))


def test_retry_after_zero_on_a_503_says_retry_now() -> None:
    assert says_retry_now(503, {"retry-after": " 0 "})
    assert not says_retry_now(503, {"retry-after": "5"})
    assert not says_retry_now(429, {"retry-after": "0"})
    assert not says_retry_now(503, {})


@pytest.mark.parametrize(("body", "draining"), [
    (error("The worker is DRAINING: retry elsewhere"), True),
    (json.dumps({"message": "worker draining"}).encode(), True),
    (json.dumps({"detail": "draining"}).encode(), True),
    (json.dumps({"error": "draining, retry elsewhere"}).encode(), True),
    (error("overloaded"), False),
    (json.dumps({"prompt": "draining"}).encode(), False),  # not a message field
    (b"draining", False),  # not JSON
    (b"\xff\xfe", False),
])
def test_a_refusal_is_a_503_whose_message_says_draining(body: bytes, draining: bool) -> None:
    assert is_draining_refusal(503, {}, body) is draining


def test_a_refusal_needs_a_503() -> None:
    assert not is_draining_refusal(500, {"retry-after": "0"}, error("draining"))
    assert is_draining_refusal(503, {"retry-after": "0"}, b"")


def test_a_compressed_body_is_not_read_as_a_refusal() -> None:
    assert not is_draining_refusal(503, {"content-encoding": "gzip"}, error("draining"))
