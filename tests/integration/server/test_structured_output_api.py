"""Structured output over HTTP with SmolLM2 and the official client: /generate's json_schema,
regex and ebnf, response_format json_object / json_schema, tool_choice "required" and a
named function (forced calls whose arguments fit the schema, one with parallel_tool_calls
false), with n > 1, streaming and a cached prefix; bad constraints are 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from hicache.model.gguf_cache import ConvertedModel
from hicache.server.structured_output import MAX_PARALLEL_CALLS
from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"enum": ["Paris", "Rome", "Tokyo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 24},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                      "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False},
    },
}


def check_person(value: Any) -> None:
    """PERSON by hand (jsonschema is not a dependency)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "city"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert value["city"] in ("Paris", "Rome", "Tokyo")


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "add", name
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


@pytest.fixture(scope="module")
def server(smollm2: ConvertedModel) -> Iterator[RunningServer]:
    with serve_in_thread(["--model-path", str(smollm2.path)]) as running:
        yield running


@pytest.fixture(name="client")
def client_fixture(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_generate_json_schema_regex_and_ebnf(server: RunningServer) -> None:
    cases = [
        ({"json_schema": json.dumps(PERSON)}, lambda t: check_person(json.loads(t))),
        ({"regex": r"(yes|no), [0-9]{1,3} (apples|pears)"},
         lambda t: re.fullmatch(r"(yes|no), [0-9]{1,3} (apples|pears)", t) or pytest.fail(t)),
        ({"ebnf": 'root ::= "The answer is " [0-9]+ "."'},
         lambda t: re.fullmatch(r"The answer is [0-9]+\.", t) or pytest.fail(t)),
    ]
    for constraint, check in cases:
        body = {"text": "Describe a person who lives in a big city.",
                "sampling_params": {"max_new_tokens": 64, "temperature": 0, **constraint}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out = response.json()
        check(out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("body, message", [
    ({"regex": "[a-"}, "invalid regex"),
    ({"ebnf": "root ::= "}, "invalid ebnf"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "give one of"),
])
def test_a_bad_constraint_is_a_400(server: RunningServer, body: dict[str, Any],
                                   message: str) -> None:
    response = httpx.post(f"{server.url}/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 4, **body}})
    assert response.status_code == 400, response.text
    assert message in response.text


def test_response_format_json_schema_with_n_and_a_cached_prefix(client: openai.OpenAI) -> None:
    messages = ask("Invent a person: name, age and city. Answer in JSON. " * 6)
    fmt: Any = {"type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    cold = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=80, temperature=0, response_format=fmt)
    warm = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=80, temperature=0, response_format=fmt)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    check_person(json.loads(cold.choices[0].message.content or ""))
    sampled = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=1.0, n=3,  # type: ignore[arg-type]
        seed=7, response_format=fmt)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    for choice in sampled.choices:
        check_person(json.loads(choice.message.content or ""))
        assert choice.finish_reason == "stop"


def test_response_format_json_object_and_schema_streamed(client: openai.OpenAI) -> None:
    formats: list[Any] = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    ]
    for fmt in formats:
        stream = client.chat.completions.create(
            model=MODEL, messages=ask('Answer with the JSON object {"ok": true}.'),  # type: ignore[arg-type]
            max_tokens=96, temperature=0, stream=True, response_format=fmt)
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        text = "".join(choice.delta.content or "" for choice in chunks)
        assert chunks[-1].finish_reason == "stop", text
        value = json.loads(text)
        assert isinstance(value, dict), text
        if fmt["type"] == "json_schema":
            check_person(value)


def test_tool_choice_required_forces_a_valid_call(client: openai.OpenAI) -> None:
    for prompt in ("What is the weather in Paris?", "Add 3 and 4.", "Tell me a joke."):
        answer = client.chat.completions.create(
            # Room for the most calls the grammar allows (4): a small model repeats its call.
            model=MODEL, messages=ask(prompt), max_tokens=300, temperature=0,  # type: ignore[arg-type]
            tools=[WEATHER, ADD], tool_choice="required")  # type: ignore[list-item]
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", repr(choice.message.content)
        calls = choice.message.tool_calls or []
        assert calls
        for call in calls:
            check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]


def test_a_named_function_without_parallel_calls_is_one_call_to_it(
    client: openai.OpenAI,
) -> None:
    for parallel in (False, True):
        answer = client.chat.completions.create(
            model=MODEL, messages=ask("What is the weather in Rome?"), max_tokens=300,  # type: ignore[arg-type]
            temperature=0, tools=[WEATHER, ADD], parallel_tool_calls=parallel,  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "add"}})
        calls = answer.choices[0].message.tool_calls or []
        assert answer.choices[0].finish_reason == "tool_calls"
        assert calls and all(c.function.name == "add" for c in calls)  # type: ignore[union-attr]
        assert len(calls) == 1 if not parallel else 1 <= len(calls) <= MAX_PARALLEL_CALLS
        for call in calls:
            check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]


@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"response_format": {"type": "xml"}}, "not supported"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "one constraint"),
])
def test_bad_structured_chat_requests_are_400s(server: RunningServer, extra: dict[str, Any],
                                               message: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ask("hi"), "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert message in response.text
