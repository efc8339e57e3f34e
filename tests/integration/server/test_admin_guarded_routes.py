"""/flush_cache and /abort_request with abort_all need the admin key on a server that has one.

Both act on every client's requests: one drops everyone's cached prefixes, the
other stops everyone's generations. A real server (tiny engine, uvicorn on a
loopback port) started with ``--admin-api-key`` refuses them without the key
(401, nothing flushed or aborted: a running stream goes on to its end) and
serves them with it. Aborting one's own request by rid needs no key. A server
without a key serves them to anyone, as SGLang does.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tests.server_fixtures import RunningServer, serve_in_thread

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 60.0
STREAM_TOKENS = 48
# A stream that outlasts any abort sent while it runs (the tiny model's context allows it).
LONG_STREAM_TOKENS = 1900


def _cached_tokens(server: RunningServer, text: str) -> int:
    answer = httpx.post(f"{server.url}/generate", timeout=TIMEOUT_S, json={
        "text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert answer.status_code == 200, answer.text
    cached: int = answer.json()["meta_info"]["cached_tokens"]
    return cached


def _stream_through(
    server: RunningServer, rid: str, during: Any, tokens: int = LONG_STREAM_TOKENS
) -> dict[str, Any]:
    """A streamed request of ``tokens`` tokens; ``during()`` runs once it produces tokens;
    its last chunk."""
    events: list[str] = []
    producing = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/generate", timeout=TIMEOUT_S, json={
            "text": "count with me", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        }) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(line.removeprefix("data: "))
                    producing.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert producing.wait(TIMEOUT_S), "the stream never produced a token"
        during()
    finally:
        reader.join(TIMEOUT_S)
    last: dict[str, Any] = json.loads(events[-1])
    return last


def test_a_keyed_server_guards_flush_and_abort_all() -> None:
    with serve_in_thread(admin_api_key=KEY) as server:
        prompt = "the same prompt, twice over, long enough for a page or two of cache"
        _cached_tokens(server, prompt)
        assert server.wait_idle()
        refused = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT_S)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT_S,
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert _cached_tokens(server, prompt) > 0  # nothing was flushed
        assert server.wait_idle()
        flushed = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT_S, headers=AUTH)
        assert flushed.status_code == 200 and flushed.json()["flushed"] is True
        assert _cached_tokens(server, prompt) == 0

        statuses: list[int] = []

        def abort_all_without_key() -> None:
            statuses.append(httpx.post(f"{server.url}/abort_request", timeout=TIMEOUT_S,
                                       json={"abort_all": True}).status_code)

        last = _stream_through(server, "mine", abort_all_without_key, STREAM_TOKENS)
        assert statuses == [401]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": STREAM_TOKENS}

        def abort_all_with_key() -> None:
            statuses.append(httpx.post(f"{server.url}/abort_request", timeout=TIMEOUT_S,
                                       json={"abort_all": True}, headers=AUTH).status_code)

        last = _stream_through(server, "mine-2", abort_all_with_key)
        assert statuses == [401, 200]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"

        def abort_own_rid() -> None:  # no key needed
            statuses.append(httpx.post(f"{server.url}/abort_request", timeout=TIMEOUT_S,
                                       json={"rid": "mine-3"}).status_code)

        last = _stream_through(server, "mine-3", abort_own_rid)
        assert statuses == [401, 200, 200]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert server.wait_idle()


def test_a_server_without_a_key_serves_them_to_anyone() -> None:
    with serve_in_thread() as server:
        assert httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT_S).status_code == 200
        answer = httpx.post(f"{server.url}/abort_request", timeout=TIMEOUT_S,
                            json={"abort_all": True})
        assert answer.status_code == 200
