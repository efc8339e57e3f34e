"""A streamed event is one line to every line reader: text holding characters that
str.splitlines (and so httpx's iter_lines) takes for line ends still arrives as one JSON
event, equal to what was sent."""

from __future__ import annotations

import json

import httpx
import pytest

from hicache.server.sse import event


@pytest.mark.parametrize("text", [
    "a\u2028b", "a\u2029b", "a\x85b", "\x1c\x1d\x1e\x0b\x0c", "\x7f} {\U0001f600\ufffd",
])
def test_an_event_is_one_line_of_json_whatever_its_text_holds(text: str) -> None:
    payload = {"text": text, "meta_info": {"id": "x"}}
    frame = event(payload)
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    lines = frame.rstrip("\n").splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: "):]) == payload
    # httpx's reader of a streamed response agrees.
    response = httpx.Response(200, content=(frame + frame).encode())
    read = [line for line in response.iter_lines() if line]
    assert [json.loads(line[len("data: "):]) for line in read] == [payload, payload]


def test_other_text_stays_as_it_is() -> None:
    assert event({"text": "héllo ✓"}) == 'data: {"text":"héllo ✓"}\n\n'
