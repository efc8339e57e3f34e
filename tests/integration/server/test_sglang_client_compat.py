"""What SGLang's clients need from a worker, checked without SGLang installed.

- ``/model_info``'s ``tokenizer_path`` (and ``/server_info``'s ``model_path`` when the
  server was given no model path) is a dir transformers' ``AutoTokenizer`` loads, with
  the server's own ids: bench_serving and SGLang's router load their tokenizer from it.
- Requests may name the model by that dir (bench_multiturn.py's ``--model-path``).
- Streamed OpenAI responses asked for ``return_cached_tokens_details`` carry ``sglext``
  (and the usage) on the chunk with the finish reason, and every completions chunk has
  a choice (bench_serving's completions client indexes ``choices[0]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.byte_level_dir import byte_tokenizer_dir
from tests.server_fixtures import RunningServer, serve_in_thread

TEXTS = ["hello world", "héllo wörld 中文 😀", " two  spaces\n\ttab", "a<|user|>b<|end|>"]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def test_byte_tokenizer_dir_loads_in_transformers_with_the_servers_ids(tmp_path: Path) -> None:
    reference = AutoTokenizer.from_pretrained(str(byte_tokenizer_dir(tmp_path)))
    ours = ByteTokenizer()
    for text in TEXTS:
        assert reference.encode(text) == ours.encode(text)
        assert reference.decode(ours.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages)
    # Clients draw random prompt ids below vocab_size: the bytes, never a special.
    assert reference.vocab_size == 256


def test_model_info_advertises_a_tokenizer_dir_clients_can_load(server: RunningServer) -> None:
    model_info = httpx.get(f"{server.url}/model_info").json()
    server_info = httpx.get(f"{server.url}/server_info").json()
    path = model_info["tokenizer_path"]
    assert path is not None and Path(path, "tokenizer.json").is_file()
    # The router reads the tokenizer from /server_info's model_path alone.
    assert server_info["model_path"] == path
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("cache me", add_special_tokens=False)
    answer = httpx.post(f"{server.url}/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).json()
    assert answer["meta_info"]["prompt_tokens"] == len(ids)


def test_requests_may_name_the_model_by_its_tokenizer_dir(server: RunningServer) -> None:
    path = httpx.get(f"{server.url}/model_info").json()["tokenizer_path"]
    body = {"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200
    body["model"] = "some-other-model"  # served too (--strict-model-name would refuse it)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streams_carry_sglext_and_usage_on_the_finishing_chunk(
    server: RunningServer, route: str
) -> None:
    prompt = "the same long prefix, twice over, so that the second request hits the cache. "
    body: dict[str, Any] = {"model": "dummy-tiny", "max_tokens": 3, "stream": True,
                            "return_cached_tokens_details": True, "ignore_eos": True}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt * 3}]
    else:
        body["prompt"] = prompt * 3
    with httpx.Client(timeout=30.0) as client:
        client.post(f"{server.url}{route}", json={**body, "stream": False})
        assert server.wait_idle()
        with client.stream("POST", f"{server.url}{route}", json=body) as response:
            assert response.status_code == 200
            chunks = _events(response)
    assert all(chunk["choices"] for chunk in chunks)  # no usage-only chunk unasked
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1
    last = finishing[0]
    details = last["sglext"]["cached_tokens_details"]
    usage = last["usage"]
    cached = details["device"] + details["host"] + details["storage"]
    assert cached == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["prompt_tokens"] > cached and usage["completion_tokens"] == 3
    assert all("sglext" not in c for c in chunks if c is not last)


def test_streams_without_the_extension_stay_openai_shaped(server: RunningServer) -> None:
    body = {"model": "dummy-tiny", "prompt": "plain", "max_tokens": 2, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True}, "return_cached_tokens_details": True}
    with httpx.Client(timeout=30.0) as client, client.stream(
        "POST", f"{server.url}/v1/completions", json=body
    ) as response:
        chunks = _events(response)
    # With a usage chunk to come, the finishing chunk carries sglext but not the usage.
    finishing = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert "sglext" in finishing and "usage" not in finishing
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    body.pop("return_cached_tokens_details")
    with httpx.Client(timeout=30.0) as client, client.stream(
        "POST", f"{server.url}/v1/completions", json=body
    ) as response:
        assert all("sglext" not in c for c in _events(response))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_samples_carry_their_own_sglext_and_the_usage_once(
    server: RunningServer, route: str
) -> None:
    prompt = f"{route}: n samples of one prompt, streamed with the cache report. " * 2
    body: dict[str, Any] = {"model": "dummy-tiny", "max_tokens": 3, "stream": True, "n": 3,
                            "temperature": 1.0, "seed": 3,
                            "return_cached_tokens_details": True, "ignore_eos": True}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    with httpx.Client(timeout=30.0) as client:
        whole = client.post(f"{server.url}{route}", json={**body, "stream": False}).json()
        assert server.wait_idle()
        with client.stream("POST", f"{server.url}{route}", json=body) as response:
            assert response.status_code == 200
            chunks = _events(response)
    assert all(chunk["choices"] for chunk in chunks)
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in finishing) == [0, 1, 2]
    # Each choice's finishing chunk has that sample's sglext; nothing else has one.
    assert all("sglext" in c for c in finishing)
    assert sum("sglext" in c for c in chunks) == 3
    # The usage once, on the last finishing chunk: the prompt counted once (as unstreamed).
    with_usage = [c for c in chunks if "usage" in c]
    assert with_usage == [finishing[-1]]
    usage = with_usage[0]["usage"]
    assert usage["completion_tokens"] == 9
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    first = next(c for c in finishing if c["choices"][0]["index"] == 0)
    details = first["sglext"]["cached_tokens_details"]
    assert details["device"] + details["host"] + details["storage"] == \
        usage["prompt_tokens_details"]["cached_tokens"] > 0
