"""Hermes / Qwen ``<tool_call>`` blocks in model output, parsed whole and streamed."""

from __future__ import annotations

import json

import pytest

from hicache.server.tool_parser import ToolCallStream, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def test_text_without_calls_is_all_content() -> None:
    parsed = parse_tool_calls("just an answer")
    assert parsed.content == "just an answer" and parsed.tool_calls == ()


def test_calls_after_some_content() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Zürich", "unit": "c"}
    assert "Zürich" in parsed.tool_calls[0].arguments  # not ASCII-escaped
    assert parsed.tool_calls[1].arguments == "{}"
    ids = [c.id for c in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_only_calls_means_no_content_and_an_unclosed_last_block_counts() -> None:
    parsed = parse_tool_calls(f"<tool_call>\n{TIME}\n")  # stopped before the closing tag
    assert parsed.content is None
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_arguments_as_json_text_or_named_parameters() -> None:
    text = ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "g", "parameters": {"y": 2}}</tool_call>')
    calls = parse_tool_calls(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {"y": 2})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        f"<tool_call>{TIME}</tool_call> and then some prose",
        f"<tool_call>{TIME}</tool_call> prose <tool_call>{TIME}</tool_call>",
    ],
)
def test_malformed_calls_come_back_as_content(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == () and parsed.content == text


@pytest.mark.parametrize(
    "text",
    [
        f"Checking the weather now. <tool_call>\n{WEATHER}\n</tool_call>",
        "No tools needed: the answer is 42 < 43.",
        "<tool_call>{broken",
        f"<tool_call>{TIME}</tool_call>",
        "ends with a partial tag <tool_c",
    ],
)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streaming_gives_the_same_content_and_calls(text: str, piece: int) -> None:
    stream = ToolCallStream()
    shown = [stream.push(text[i : i + piece]) for i in range(0, len(text), piece)]
    rest, calls = stream.finish()
    whole = parse_tool_calls(text)
    assert "".join(shown) + rest == (whole.content or "")
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    assert all("<tool_call>" not in s for s in shown)
