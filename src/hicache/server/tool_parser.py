"""Tool calls in a model's output, in the Hermes / Qwen format, back into OpenAI ``tool_calls``.

Hermes-style and Qwen2.5/Qwen3 chat templates teach the model to call a tool by
writing a JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first call is the message's content. When a block is not an
object with a string ``name`` (and object ``arguments``), the whole output is
returned as content: a malformed call is shown, never silently dropped.
``ToolCallStream`` does the same for a streamed answer: content streams until a
call starts (text that may be the start of the tag is held back), and the calls
come in one delta at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A block runs to its closing tag, or to the end of the text (a generation that
# stopped on "</tool_call>" as a stop string, or ran out of tokens after the JSON).
_BLOCK = re.compile(
    re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL
)


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the OpenAI API writes it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the model wrote nothing but calls
    tool_calls: tuple[ParsedToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> ParsedOutput:
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedOutput(text, ())
    calls: list[ParsedToolCall] = []
    end = start
    for match in _BLOCK.finditer(text, start):
        if text[end : match.start()].strip():
            return ParsedOutput(text, ())  # prose between calls: not a clean call list
        call = _call(match.group(1))
        if call is None:
            return ParsedOutput(text, ())
        calls.append(call)
        end = match.end()
    if text[end:].strip():
        return ParsedOutput(text, ())
    content = text[:start].rstrip()
    return ParsedOutput(content or None, tuple(calls))


def _call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    # Some models write "parameters" (the schema's word) instead of "arguments".
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already JSON text: keep it when it is an object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of the start tag."""
    for size in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Streams the content of an answer that may end in tool calls.

    ``push`` returns the content that can be shown now; ``finish`` the rest of
    the content and the calls. What is streamed plus what ``finish`` returns is
    ``parse_tool_calls``' content of the whole text (or the whole text).
    """

    def __init__(self) -> None:
        self._text = ""
        self._emitted = 0
        self._in_call = False

    def push(self, delta: str) -> str:
        self._text += delta
        if self._in_call:
            return ""
        start = self._text.find(TOOL_CALL_START, self._emitted)
        if start >= 0:
            self._in_call = True
            safe = len(self._text[:start].rstrip())
        else:
            # Trailing whitespace waits too: before a call it is not part of the content.
            held = _partial_tag(self._text)
            safe = len(self._text[: len(self._text) - held].rstrip())
        safe = max(safe, self._emitted)
        out = self._text[self._emitted : safe]
        self._emitted = safe
        return out

    def finish(self) -> tuple[str, tuple[ParsedToolCall, ...]]:
        parsed = parse_tool_calls(self._text)
        if parsed.tool_calls:
            return "", parsed.tool_calls
        rest = self._text[self._emitted :]
        self._emitted = len(self._text)
        return rest, ()
