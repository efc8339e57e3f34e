"""SGLang's /generate semantics over HTTP: request ids, batches, stop tokens and what they
leave in the text, special tokens, the finish reason's ``matched``, cache namespaces."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.tokenizer.byte_level import ByteTokenizer
from tests.server_fixtures import RunningServer, serve_in_thread

TIMEOUT = httpx.Timeout(30.0)
SPECIALS = range(256, 256 + len(ByteTokenizer.SPECIALS))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


def post(server: RunningServer, payload: dict[str, Any], status: int = 200) -> Any:
    response = httpx.post(f"{server.url}/generate", json=payload, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    return response.json()


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def test_rid_is_the_request_id(server: RunningServer) -> None:
    one = post(server, {"text": "name me", "rid": "my-request-1", "sampling_params": greedy(2)})
    assert one["meta_info"]["id"] == "my-request-1"
    unnamed = post(server, {"text": "name me", "sampling_params": greedy(2)})
    assert len(unnamed["meta_info"]["id"]) == 32  # generated


def test_batch_runs_every_prompt_as_alone(server: RunningServer) -> None:
    prompts = ["first prompt", "a second, longer prompt", "third"]
    alone = [post(server, {"text": p, "sampling_params": greedy(6)}) for p in prompts]
    batch = post(server, {"text": prompts, "rid": ["a", "b", "c"],
                          "sampling_params": greedy(6)})
    assert isinstance(batch, list) and len(batch) == 3
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in alone]
    assert [r["text"] for r in batch] == [r["text"] for r in alone]
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b", "c"]

    ids = [[1, 2, 3, 4], [5, 6, 7]]
    per_item = post(server, {"input_ids": ids, "rid": "job",
                             "sampling_params": [greedy(2), greedy(4)]})
    assert [r["meta_info"]["id"] for r in per_item] == ["job_0", "job_1"]
    assert [len(r["output_ids"]) for r in per_item] == [2, 4]
    assert [r["meta_info"]["prompt_tokens"] for r in per_item] == [4, 3]
    assert server.wait_idle()
    server.engine.check_integrity()


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"text": ["a", "b"], "rid": ["x"]}, "rid has 1 items for a batch of 2"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "must be different"),
        ({"text": "a", "rid": ["x"]}, "needs a batch"),
        ({"text": ["fine", ""]}, "prompt 1 of the batch: the prompt is empty"),
    ],
)
def test_bad_batches_are_refused(server: RunningServer, payload: dict[str, Any],
                                 words: str) -> None:
    error = post(server, payload, status=400)["error"]
    assert words in error["message"]
    assert server.wait_idle()


def test_a_rid_in_flight_is_refused(server: RunningServer) -> None:
    payload = {"text": "a long answer", "rid": "busy", "stream": True,
               "sampling_params": greedy(server.engine.max_context_len - 64)}
    with httpx.Client(timeout=TIMEOUT) as client, client.stream(
        "POST", f"{server.url}/generate", json=payload
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        again = post(server, {"text": "x", "rid": "busy"}, status=400)
        assert "already in flight" in again["error"]["message"]
    assert server.wait_idle()
    # Free again once the first request is gone.
    assert post(server, {"text": "x", "rid": "busy", "sampling_params": greedy(1)})


def test_stop_token_ends_the_request_and_is_matched(server: RunningServer) -> None:
    free = post(server, {"text": "stop somewhere", "sampling_params": greedy(24)})
    tokens = free["output_ids"]
    # The first token the run had not produced before (the stop fires at its first use).
    at = next((i for i, t in enumerate(tokens) if i and t not in tokens[:i]), 0)
    stop = tokens[at]
    cut = post(server, {"text": "stop somewhere",
                        "sampling_params": greedy(24, stop_token_ids=[stop])})
    assert cut["output_ids"] == tokens[: at + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = post(server, {"text": "stop somewhere", "sampling_params": greedy(
        24, stop_token_ids=[stop], no_stop_trim=True, skip_special_tokens=False)})
    decode = ByteTokenizer().decode
    assert cut["text"] == decode(tokens[:at])
    assert kept["text"] == decode(tokens[: at + 1], skip_special_tokens=False)


def test_stop_string_is_matched_and_kept_on_request(server: RunningServer) -> None:
    free = post(server, {"text": "say more", "sampling_params": greedy(24)})
    text = free["text"]
    at = next((i for i, c in enumerate(text) if i and c not in text[:i]), 0)
    stop = text[at]
    cut = post(server, {"text": "say more",
                        "sampling_params": greedy(24, stop=["never-there", stop])})
    assert cut["text"] == text[:at]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = post(server, {"text": "say more",
                         "sampling_params": greedy(24, stop=[stop], no_stop_trim=True)})
    assert kept["text"].startswith(text[:at] + stop)
    assert kept["meta_info"]["finish_reason"]["matched"] == stop


def test_special_tokens_show_when_not_skipped(server: RunningServer) -> None:
    # The dummy model writes special tokens now and then: find a prompt where it does.
    for i in range(40):
        payload = {"text": f"prompt number {i}", "sampling_params": greedy(32)}
        plain = post(server, payload)
        if any(t in SPECIALS for t in plain["output_ids"]):
            break
    else:
        pytest.fail("no greedy output with a special token: change the search")
    kept = post(server, {**payload, "sampling_params": greedy(32, skip_special_tokens=False)})
    assert kept["output_ids"] == plain["output_ids"]
    tokenizer = ByteTokenizer()
    assert plain["text"] == tokenizer.decode(plain["output_ids"])
    assert kept["text"] == tokenizer.decode(plain["output_ids"], skip_special_tokens=False)
    assert kept["text"] != plain["text"] and "<|" in kept["text"]
    # Streamed, the last chunk carries the same text.
    with httpx.stream("POST", f"{server.url}/generate", timeout=TIMEOUT,
                      json={**payload, "stream": True,
                            "sampling_params": greedy(32, skip_special_tokens=False)}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["text"] == kept["text"]


def test_cache_namespaces_keep_requests_apart(server: RunningServer) -> None:
    prompt = list(range(1, 1 + 4 * 16 + 3))
    first = post(server, {"input_ids": prompt, "extra_key": "tenant-a",
                          "sampling_params": greedy(1)})
    assert first["meta_info"]["cached_tokens"] == 0
    same = post(server, {"input_ids": prompt, "extra_key": "tenant-a",
                         "sampling_params": greedy(1)})
    assert same["meta_info"]["cached_tokens"] == 4 * 16
    salted = post(server, {"input_ids": prompt, "extra_key": "tenant-a", "cache_salt": "s",
                           "sampling_params": greedy(1)})
    assert salted["meta_info"]["cached_tokens"] == 0


def test_max_new_tokens_null_is_the_rest_of_the_context(server: RunningServer) -> None:
    prompt = [7] * (server.engine.max_context_len - 3)
    answer = post(server, {"input_ids": prompt,
                           "sampling_params": {"max_new_tokens": None, "ignore_eos": True,
                                               "temperature": 0}})
    assert answer["meta_info"]["completion_tokens"] == 3
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_a_batch_and_its_samples_stream_with_their_index(server: RunningServer) -> None:
    """Streamed, a batch (here two prompts, two greedy samples each) sends every item's
    chunks tagged with its index; each item's last chunk is its non-streamed answer."""
    payload: dict[str, Any] = {
        "input_ids": [[1, 2, 3, 4, 5], [6, 7, 8]],
        "sampling_params": {**greedy(5), "n": 2},
    }
    whole = post(server, payload)
    assert len(whole) == 4
    last: dict[int, dict[str, Any]] = {}
    with httpx.Client(timeout=TIMEOUT) as client, client.stream(
        "POST", f"{server.url}/generate", json={**payload, "stream": True}
    ) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line)
        assert "error" not in chunk, chunk
        last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2, 3]
    for index, answer in enumerate(whole):
        assert last[index]["output_ids"] == answer["output_ids"]
        assert last[index]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    assert server.wait_idle()
    server.engine.check_integrity()
