"""/v1/completions with a batch of prompts (a list of strings or of token-id lists), as
OpenAI serves it: n choices per prompt, numbered prompt-major, each the choice the prompt
alone would have got; usage sums the prompts (each counted once) and every completion;
streamed too. A 400 ("batched prompts are not supported") before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "tiny-test-model"
PROMPTS = ["a batch of prompts, the first one", "the second prompt of the batch, longer"]
# Seeded sampling: sample j of every prompt draws with seed + j, so the samples of one
# prompt differ and each is reproducible alone.
ARGS: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "n": 2, "temperature": 1.0,
                        "seed": 11, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as oai:
        yield oai


def alone(client: openai.OpenAI, prompt: str | list[int], echo: bool = False
          ) -> tuple[list[str], int]:
    """Each prompt's choices and prompt tokens when sent by itself."""
    result = client.completions.create(prompt=prompt, echo=echo, **ARGS)
    assert result.usage is not None
    return [c.text for c in result.choices], result.usage.prompt_tokens


def test_a_batch_of_strings_gets_n_choices_per_prompt_in_order(client: openai.OpenAI) -> None:
    singles = [alone(client, p) for p in PROMPTS]
    result = client.completions.create(prompt=PROMPTS, **ARGS)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == singles[0][0] + singles[1][0]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.usage is not None
    assert result.usage.prompt_tokens == singles[0][1] + singles[1][1]
    assert result.usage.completion_tokens == 4 * 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + 24


def test_a_batch_of_token_id_lists_with_echo(client: openai.OpenAI) -> None:
    ids = [[104, 105, 32, 116, 104, 101, 114, 101], [111, 107, 46]]
    singles = [alone(client, p, echo=True) for p in ids]
    result = client.completions.create(prompt=ids, echo=True, **ARGS)
    texts = [c.text for c in result.choices]
    assert texts == singles[0][0] + singles[1][0]
    assert texts[0].startswith("hi there") and texts[2].startswith("ok.")
    # One list of token ids is one prompt, not a batch.
    one = client.completions.create(prompt=ids[0], **{**ARGS, "n": 1})
    assert len(one.choices) == 1


def test_a_streamed_batch(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt=PROMPTS, **ARGS)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.completions.create(prompt=PROMPTS, stream=True,
                                           stream_options={"include_usage": True}, **ARGS):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert set(reasons.values()) == {"length"}
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 24


def test_an_empty_prompt_in_a_batch_is_named(client: openai.OpenAI, server: RunningServer
                                              ) -> None:
    with pytest.raises(openai.BadRequestError, match=r"empty \(prompt\.1\)"):
        client.completions.create(prompt=["fine", ""], **ARGS)
    with pytest.raises(openai.BadRequestError, match="prompt must be"):
        client.completions.create(prompt=["fine", 5], **ARGS)  # type: ignore[list-item]
    assert server.wait_idle()  # nothing was left running
