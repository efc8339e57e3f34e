"""``n`` samples of one prompt: OpenAI completions and chat (streamed and not) and SGLang's
/generate. The samples share the prompt's cached pages; usage counts the prompt once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "tiny-test-model"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30.0
    ) as oai:
        yield oai


def prompt(tag: str) -> str:
    return f"{tag}: samples of one prompt share its cached pages. " * 2


def test_completion_samples_share_the_prompt_and_count_it_once(
    client: openai.OpenAI, server: RunningServer
) -> None:
    text = prompt("completions")
    single = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert single.usage is not None
    prompt_tokens = single.usage.prompt_tokens
    server.engine.flush_cache()
    counters = server.engine.scheduler.counters
    cached_before = counters.num_cached_device_tokens
    args: dict[str, Any] = {"model": MODEL, "prompt": text, "max_tokens": 8, "n": 4,
                            "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
    result = client.completions.create(**args)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage is not None
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 32
    # Seeds seed + i: the samples differ, and the same request gives the same samples.
    texts = [c.text for c in result.choices]
    assert len(set(texts)) > 1
    assert [c.text for c in client.completions.create(**args).choices] == texts
    # The 3 later samples reused the first one's whole pages (the cache was empty).
    whole_pages = (prompt_tokens - 1) // 16 * 16
    assert counters.num_cached_device_tokens - cached_before >= 3 * whole_pages > 0


def test_greedy_samples_are_allowed_and_equal(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=prompt("greedy"), max_tokens=5,
                                       n=2, temperature=0)
    assert len(result.choices) == 2
    assert result.choices[0].text == result.choices[1].text


def test_chat_samples_streamed_and_not(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": prompt("chat")}],
        "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    contents: dict[int, str] = {}
    finished: set[int] = set()
    usage = None
    for chunk in client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert contents == {c.index: c.message.content for c in whole.choices}
    assert usage is not None and usage.completion_tokens == 18
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_generate_n_answers_a_list_of_samples(server: RunningServer) -> None:
    body = {"text": prompt("generate"), "rid": "many",
            "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0,
                                "ignore_eos": True}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    results = response.json()
    assert [r["meta_info"]["id"] for r in results] == ["many-0", "many-1", "many-2"]
    assert all(len(r["output_ids"]) == 4 for r in results)
    # Streamed, every sample's chunks carry its index (the same rid again is free now).
    streamed = httpx.post(f"{server.url}/generate", json={**body, "stream": True}, timeout=30.0)
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    last = {chunk["index"]: chunk for chunk in chunks}
    assert sorted(last) == [0, 1, 2]
    assert [last[i]["meta_info"]["id"] for i in range(3)] == ["many-0", "many-1", "many-2"]
    assert all(len(last[i]["output_ids"]) == 4 for i in range(3))
    for bad in (0, 65):
        refused = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                             json={"prompt": "hi", "n": bad, "max_tokens": 2})
        assert refused.status_code == 400 and "n must be" in json.dumps(refused.json())
