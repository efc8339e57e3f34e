"""A real agent framework (LangChain's ChatOpenAI, pinned in the dev extra) drives a
tool-calling loop against a served SmolLM2: three forced tool rounds (tool_choice
"required", one call a turn), each call run by the test and its result fed back as a
ToolMessage (so the history holds assistant messages with null content and tool_calls), a
user message sent as a list of text parts, then a free turn that ends the loop with text.

Invariants checked: every call's arguments fit the tool's schema (the tool's own pydantic
model accepts them), the loop ends within its bounded number of turns, and every turn after
the first reuses the growing conversation's cached prefix (cached_tokens > 0)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from hicache.model.gguf_cache import ConvertedModel
from tests.server_fixtures import RunningServer, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
TOOL_ROUNDS = 3
# A bound on the whole loop: the forced rounds, the final answer, and slack for nothing.
MAX_TURNS = TOOL_ROUNDS + 1


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


def cached_tokens(message: AIMessage) -> int:
    """The reused prompt tokens the server reported, as LangChain surfaces them."""
    usage = message.response_metadata["token_usage"]
    details: dict[str, Any] = usage.get("prompt_tokens_details") or {}
    reported = int(details.get("cached_tokens") or 0)
    # LangChain's own normalised view must agree with the raw usage.
    assert message.usage_metadata is not None
    assert message.usage_metadata.get("input_token_details", {}).get("cache_read", 0) == reported
    return reported


@pytest.fixture(scope="module")
def server(smollm2: ConvertedModel) -> Iterator[RunningServer]:
    with serve_in_thread(["--model-path", str(smollm2.path)]) as running:
        yield running


def test_langchain_tool_loop_with_forced_calls_and_cached_turns(server: RunningServer) -> None:
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL,  # type: ignore[arg-type]
                     temperature=0, max_retries=0, timeout=120, max_completion_tokens=64)
    forced = llm.bind_tools([add], tool_choice="required", parallel_tool_calls=False)
    messages: list[BaseMessage] = [
        # Parts, as agent frameworks send them: the server joins the text parts.
        HumanMessage(content=[{"type": "text", "text": "You are a careful calculator."},
                              {"type": "text", "text": "Add 2 and 3 with the add tool."}]),
    ]
    results: list[int] = []
    cached: list[int] = []
    answer: AIMessage | None = None
    for turn in range(MAX_TURNS):
        if turn < TOOL_ROUNDS:
            reply = forced.invoke(messages)
            assert isinstance(reply, AIMessage)
            assert reply.response_metadata["finish_reason"] == "tool_calls", reply
            assert len(reply.tool_calls) == 1, reply.tool_calls
            call = reply.tool_calls[0]
            assert call["name"] == "add"
            assert set(call["args"]) == {"a", "b"}, call["args"]
            assert all(type(v) is int for v in call["args"].values()), call["args"]
            # The tool validates its arguments against its own schema before it runs.
            result = add.invoke(call["args"])
            assert result == call["args"]["a"] + call["args"]["b"]
            results.append(result)
            messages += [reply, ToolMessage(content=str(result), tool_call_id=call["id"])]
            if turn + 1 < TOOL_ROUNDS:
                messages.append(HumanMessage(content=f"Now add {result} and {turn + 4}."))
        else:
            messages.append(HumanMessage(content="Say the last sum in one short sentence."))
            reply = llm.invoke(messages, max_completion_tokens=16)
            assert isinstance(reply, AIMessage)
            assert not reply.tool_calls
            answer = reply
        cached.append(cached_tokens(reply))
        if answer is not None:
            break
    assert answer is not None, "the loop did not end with an answer within its turns"
    assert isinstance(answer.content, str) and answer.content.strip(), answer
    assert len(results) == TOOL_ROUNDS
    # The assistant messages sent back had null content: the server accepted them (no 4xx)
    # and every later turn found the conversation so far in the cache.
    assert all(c > 0 for c in cached[1:]), cached
