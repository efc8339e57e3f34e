"""POST /hicache/warm on real servers sharing a file L3 (``server/warm.py``): one server
fills L3, a fresh one warms its host tier from it, and a following /generate of a warmed
prompt is a host (L2) hit giving the cold answer; a small host fraction clips the warm;
per-item outcomes for prefixes L3 lacks or that are too short; bad bodies are a 400 with
nothing warmed; no L3 is a 409; the admin key is required."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

KEY = "warm-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PAGE = 16
TIMEOUT = httpx.Timeout(60.0)
# Six whole pages and a partial one each, no two alike from their first token.
PROMPTS = [[base + i for i in range(6 * PAGE + 5)] for base in (1, 120, 240, 360)]
TEXT = " ".join(f"warm{j}" for j in range(60))


def l3_args(path: Path) -> list[str]:
    extra = json.dumps({"path": str(path), "prefetch_threshold": PAGE})
    # Every hit waited for and loaded, whatever it costs: on a slow machine the default
    # policies would recompute pages the tests assert were loaded from L2 or L3.
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra,
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-reuse-policy", "load"]


def greedy_body(prompt: list[int] | str) -> dict[str, Any]:
    key = "text" if isinstance(prompt, str) else "input_ids"
    return {key: prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}


def generate(server: RunningServer, prompt: list[int] | str) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/generate", json=greedy_body(prompt), timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def warm(server: RunningServer, body: dict[str, Any], auth: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}/hicache/warm", json=body,
                      headers=AUTH if auth else {}, timeout=TIMEOUT)


@dataclass
class Filled:
    l3_dir: Path
    cold: dict[int, list[int]]  # PROMPTS index -> cold greedy output ids
    cold_text: list[int]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Filled:
    """L3 written by one server: every prompt's whole pages, with the cold answers."""
    l3_dir = tmp_path_factory.mktemp("l3")
    with serve_in_thread(l3_args(l3_dir)) as server:
        cold = {i: generate(server, p)["output_ids"] for i, p in enumerate(PROMPTS)}
        cold_text = generate(server, TEXT)["output_ids"]
        pages = len(PROMPTS) * 6 + len(server.engine.tokenize(TEXT)) // PAGE

        def stored() -> bool:
            status = server.engine.storage_status()
            return bool(status["metrics"]["backup_pages_stored"] >= pages)

        assert server.wait_until(stored), "the pages never reached L3"
    return Filled(l3_dir, cold, cold_text)


@pytest.fixture(scope="module")
def server(filled: Filled) -> Iterator[RunningServer]:
    """A fresh server on the same L3: nothing in its L1 or L2."""
    with serve_in_thread(l3_args(filled.l3_dir), admin_api_key=KEY) as running:
        yield running


def test_warmed_prompts_are_host_hits_with_the_cold_answer(
    server: RunningServer, filled: Filled
) -> None:
    response = warm(server, {"input_ids": [PROMPTS[0]]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["results"] == [
        {"index": 0, "outcome": "warmed", "tokens": 6 * PAGE, "reason": ""}
    ]
    assert body["tokens"] == 6 * PAGE and body["max_host_fraction"] == 0.5
    assert server.engine.metrics()["device_pool_used_pages"] == 0  # nothing loaded, computed

    hit = generate(server, PROMPTS[0])

    assert hit["meta_info"]["cached_tokens_details"] == {
        "device": 0, "host": 6 * PAGE, "storage": 0}
    assert hit["output_ids"] == filled.cold[0]
    again = warm(server, {"input_ids": [PROMPTS[0]]}).json()["results"][0]
    assert again == {"index": 0, "outcome": "warmed", "tokens": 0, "reason": "already cached"}


def test_texts_are_tokenized_as_generate_does(server: RunningServer, filled: Filled) -> None:
    whole = len(server.engine.tokenize(TEXT)) // PAGE * PAGE
    result = warm(server, {"text": [TEXT]}).json()["results"][0]
    assert result["outcome"] == "warmed" and result["tokens"] == whole

    hit = generate(server, TEXT)

    assert hit["meta_info"]["cached_tokens_details"]["host"] == whole
    assert hit["output_ids"] == filled.cold_text


def test_a_small_host_fraction_clips_the_warm(server: RunningServer, filled: Filled) -> None:
    host_pages = int(server.engine.metrics()["host_pool_pages"])
    fraction = 3.5 / host_pages  # room for three pages

    body = warm(server, {"input_ids": [PROMPTS[1], PROMPTS[2]],
                         "max_host_fraction": fraction}).json()

    first, second = body["results"]
    assert first["outcome"] == "clipped" and first["tokens"] == 3 * PAGE
    assert "host fraction" in first["reason"]
    assert second == {"index": 1, "outcome": "clipped", "tokens": 0,
                      "reason": "the host fraction is used up"}
    hit = generate(server, PROMPTS[1])  # the rest comes from L3 as any request's prefetch
    assert hit["meta_info"]["cached_tokens_details"] == {
        "device": 0, "host": 3 * PAGE, "storage": 3 * PAGE}
    assert hit["output_ids"] == filled.cold[1]


def test_per_item_outcomes_for_what_cannot_be_warmed(server: RunningServer) -> None:
    unseen = [500 - i for i in range(4 * PAGE)]
    body = warm(server, {"input_ids": [unseen, [5, 6, 7]]}).json()
    assert body["results"] == [
        {"index": 0, "outcome": "not_in_l3", "tokens": 0,
         "reason": f"L3 holds none of the {4 * PAGE} tokens asked for"},
        {"index": 1, "outcome": "rejected", "tokens": 0,
         "reason": f"shorter than one page ({PAGE} tokens)"},
    ]


@pytest.mark.parametrize(("body", "message"), [
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1] is empty"),
    ({"input_ids": [PROMPTS[3], [1, 10**9]]}, "out of the vocabulary"),
    ({"input_ids": [PROMPTS[3]], "text": ["hi"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"text": ["x"] * 1025}, "at most 1024"),
    ({"input_ids": [PROMPTS[3]], "max_host_fraction": 0}, "max_host_fraction"),
    ({"input_ids": [PROMPTS[3]], "max_host_fraction": 1.5}, "max_host_fraction"),
    ({"input_ids": [PROMPTS[3]], "timeout_s": 601}, "timeout_s"),
    ({"input_ids": [PROMPTS[3]], "bogus": 1}, "bogus"),
])
def test_bad_bodies_are_refused_and_warm_nothing(
    server: RunningServer, body: dict[str, Any], message: str
) -> None:
    before = server.engine.metrics()["host_pool_used_pages"]
    response = warm(server, body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert server.engine.metrics()["host_pool_used_pages"] == before


def test_a_prefix_longer_than_the_context_is_refused(server: RunningServer) -> None:
    too_long = [1] * (server.engine.max_context_len + 1)
    response = warm(server, {"input_ids": [PROMPTS[3], too_long]})
    assert response.status_code == 400
    assert "input_ids[1]" in response.json()["error"]["message"]
    assert "longer than the context" in response.json()["error"]["message"]


def test_the_admin_key_is_required(server: RunningServer) -> None:
    assert warm(server, {"input_ids": [PROMPTS[3]]}, auth=False).status_code == 401
    with serve_in_thread() as keyless:  # no admin key: the admin API is off
        assert warm(keyless, {"input_ids": [PROMPTS[3]]}).status_code == 400


def test_without_l3_or_while_draining_it_is_a_conflict() -> None:
    with serve_in_thread(["--enable-hierarchical-cache"], admin_api_key=KEY) as server:
        response = warm(server, {"input_ids": [PROMPTS[3]]})
        assert response.status_code == 409
        assert "no L3" in response.json()["error"]["message"]
        drained = httpx.post(f"{server.url}/hicache/drain", headers=AUTH, timeout=TIMEOUT)
        assert drained.status_code == 202
        response = warm(server, {"input_ids": [PROMPTS[3]]})
        assert response.status_code == 409
        assert "draining" in response.json()["error"]["message"]


def test_a_warm_past_its_timeout_answers_and_leaks_nothing(filled: Filled) -> None:
    extra = json.dumps({"backend": "file", "read_latency_ms": 1500, "prefetch_threshold": PAGE,
                        "backend_extra": {"path": str(filled.l3_dir)}})
    args = ["--enable-hierarchical-cache", "--hicache-storage-backend", "throttled",
            "--hicache-storage-backend-extra-config", extra]
    with serve_in_thread(args, admin_api_key=KEY) as slow:
        response = warm(slow, {"input_ids": [PROMPTS[3]], "timeout_s": 0.2})

        assert response.status_code == 200, response.text
        (result,) = response.json()["results"]
        assert result["outcome"] == "clipped" and result["tokens"] == 0
        assert "timed out" in result["reason"]
        assert slow.wait_idle()
        # The lookup still running when the warm ended releases what it held on return.
        assert slow.wait_until(lambda: slow.engine.metrics()["host_pool_used_pages"] == 0)
        slow.engine.check_integrity()
        assert generate(slow, PROMPTS[3])["output_ids"] == filled.cold[3]
