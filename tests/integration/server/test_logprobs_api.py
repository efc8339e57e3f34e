"""Log probabilities over HTTP: SGLang's /generate meta_info and OpenAI's completions and
chat logprobs objects, streamed and not, with the official OpenAI client where it applies."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "tiny-test-model"
PROMPT = "Log probabilities of a prompt that fills a few pages of the cache. " * 2


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


def generate(server: RunningServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def stream_generate(server: RunningServer, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      timeout=30.0) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_generate_returns_sglang_logprob_fields(server: RunningServer) -> None:
    ids = server.engine.tokenize(PROMPT)
    start = 10
    result = generate(server, input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                      logprob_start_len=start, top_logprobs_num=3, token_ids_logprob=[65, 66],
                      return_text_in_logprobs=True)
    meta = result["meta_info"]
    outputs, inputs = meta["output_token_logprobs"], meta["input_token_logprobs"]
    assert [entry[1] for entry in outputs] == result["output_ids"]
    assert [entry[1] for entry in inputs] == ids[start:]
    tokenizer = server.engine.tokenizer
    for logprob, token, text in inputs + outputs:
        assert logprob <= 0
        assert text == tokenizer.decode([token], skip_special_tokens=False)
    # Greedy: each output token is the most likely one.
    for (logprob, token, _), top in zip(outputs, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == token and math.isclose(top[0][0], logprob)
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
    assert len(meta["input_top_logprobs"]) == len(inputs)
    for asked in meta["output_token_ids_logprobs"] + meta["input_token_ids_logprobs"]:
        assert [entry[1] for entry in asked] == [65, 66]


def test_generate_logprob_defaults_and_prompt_start(server: RunningServer) -> None:
    # return_logprob alone (logprob_start_len -1): output logprobs, no prompt ones, no tops,
    # and no token text.
    plain = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True)
    meta = plain["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    assert all(entry[2] is None for entry in meta["output_token_logprobs"])
    # From 0: the first prompt token has no logprob and no top ones.
    whole = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True,
                     logprob_start_len=0, top_logprobs_num=1)["meta_info"]
    assert whole["input_token_logprobs"][0][0] is None
    assert whole["input_top_logprobs"][0] is None
    assert whole["output_token_logprobs"] == meta["output_token_logprobs"]
    off = generate(server, text=PROMPT, sampling_params=GREEDY)["meta_info"]
    assert "output_token_logprobs" not in off


def test_streamed_logprobs_accumulate_to_the_whole_ones(server: RunningServer) -> None:
    body = {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
            "logprob_start_len": 3, "top_logprobs_num": 2}
    whole = generate(server, **body)["meta_info"]
    chunks = stream_generate(server, **body)
    last = chunks[-1]["meta_info"]
    for name in ("output_token_logprobs", "input_token_logprobs"):
        assert [e[1] for e in last[name]] == [e[1] for e in whole[name]]
        assert [e[0] for e in last[name]] == pytest.approx([e[0] for e in whole[name]])
    assert [[t[1] for t in top] for top in last["output_top_logprobs"]] == \
        [[t[1] for t in top] for top in whole["output_top_logprobs"]]
    counts = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert counts == sorted(counts) and counts[-1] == GREEDY["max_new_tokens"]


def test_completion_logprobs_and_echo_score_a_prompt(client: openai.OpenAI) -> None:
    # How evaluation harnesses score a text: echo it with logprobs, generate nothing.
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=2)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == scored.usage.prompt_tokens
    # Generated tokens: each with the chosen one among its top entries (OpenAI's N + 1).
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == 4
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert top is not None and 1 <= len(top) <= 3
        assert math.isclose(top[token], logprob)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0


def test_streamed_completion_logprobs_match(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                            "logprobs": 1, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args).choices[0].logprobs
    streamed: list[float] = []
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.token_logprobs:
                streamed.extend(lp for lp in choice.logprobs.token_logprobs if lp is not None)
    assert whole is not None and whole.token_logprobs is not None
    assert streamed == pytest.approx(whole.token_logprobs)


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
        "temperature": 0, "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**args)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert whole.usage is not None and len(logprobs.content) == whole.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in logprobs.content])
    plain = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
