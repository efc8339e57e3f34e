"""The official OpenAI client, unchanged, against the server: completions and chat, both
streamed and not, usage with cached tokens, the models list, and refused options."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "tiny-test-model"
# Long enough to fill several 16-token pages, so a repeat reuses whole pages.
PROMPT = "The hierarchical cache keeps prefixes on the device, in host memory and on disk. " * 2


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(["--enable-hierarchical-cache"], served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30.0
    ) as oai:
        yield oai


def test_models_lists_the_served_name(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("some-other-model")


def test_completion_greedy_is_repeatable_and_cached(client: openai.OpenAI) -> None:
    first = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    second = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert first.object == "text_completion"
    assert first.model == MODEL
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].text == second.choices[0].text
    assert first.usage is not None and second.usage is not None
    assert first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    # The repeat reuses the first request's whole pages of the prompt.
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 16
    assert cached < second.usage.prompt_tokens and cached % 16 == 0


def test_completion_accepts_token_ids(client: openai.OpenAI) -> None:
    ids = list(range(65, 65 + 20))
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert text.usage is not None
    assert text.usage.prompt_tokens == len(ids)
    assert text.usage.completion_tokens <= 5


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    prompt = "Streaming should say exactly what the plain response says. "
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, seed=1,
        extra_body={"ignore_eos": True},
    )
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    reasons: list[str | None] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []  # the usage chunk carries no choice
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == plain.choices[0].text
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens == 20
    assert plain.usage is not None and usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_non_stream_and_stream(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about caches."},
    ]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 16

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    roles: list[str | None] = []
    pieces: list[str] = []
    reasons: list[str | None] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert roles[0] == "assistant"
    assert "".join(pieces) == plain.choices[0].message.content
    assert reasons[-1] == "length"
    # The same conversation again: its prompt pages come from the cache.
    assert usage is not None and usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_chat_template_errors_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(
            model=MODEL, messages=[cast(Any, {"role": "wizard", "content": "hi"})],
            max_tokens=4,
        )


def test_unsupported_options_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                  extra_body={"min_p": 0.5})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, best_of=2)
    # The server is still serving.
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens <= 2


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    prompt = "abc"
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = free.choices[0].text
    assert text
    # The first character that is new in the greedy output (else its first one): the
    # same greedy run with it as a stop string ends right before it.
    cut_at = next((i for i, c in enumerate(text) if i and c not in text[:i]), 0)
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=text[cut_at],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:cut_at]
