"""Tool use in chat: a tool-using conversation renders through a Qwen-style template exactly
as transformers' ``apply_chat_template`` renders it, and the official OpenAI client replays
one — the model's ``<tool_call>`` answer comes back as ``tool_calls``, streamed or not.

The model's answers are scripted (a stand-in engine that records the prompt it gets and
answers with given text, token by token, as the engine streams): no small random model
writes a tool call. The prompts it records are compared token for token with
transformers'. A real engine over the same tokenizer then serves the same requests.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hicache.engine.api import CachedTokens, GenerateOutput, GenerateRequest, RequestError
from hicache.model.presets import get_preset
from hicache.server.app import create_app
from hicache.tokenizer.chat_template import continue_final_message
from hicache.tokenizer.detokenizer import IncrementalDetokenizer
from hicache.tokenizer.hf import HFTokenizer
from tests.server_fixtures import RunningServer, serve_app_in_thread, serve_in_thread
from tests.unit.model.test_hf_tokenizer import SPECIALS, write_tokenizer

# Written in the style of Qwen2.5/Qwen3's templates: tools as JSON in the system turn,
# assistant tool calls as <tool_call> JSON, tool results grouped in a user turn, and
# enable_thinking=false writing an empty think block.
QWEN_STYLE = """\
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- else %}
You are a helpful assistant.
{%- endif %}

# Tools

You may call functions. Their signatures are inside <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call one with a JSON object inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endif %}
"""
IM_END = SPECIALS.index("<|im_end|>")
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
QUESTION: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Zürich?"},
]
CALL_ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
FINAL_ANSWER = "It is 21 degrees in Zürich."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-style")
    write_tokenizer(path, chat_template=QWEN_STYLE)
    config = dataclasses.replace(get_preset("tiny"), vocab_size=320)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, IM_END]}))
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


def reference_ids(reference: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                  **kwargs: Any) -> list[int]:
    """transformers' prompt ids, tool call arguments as objects (as its docs ask)."""
    converted = json.loads(json.dumps(messages))
    for message in converted:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    encoded = reference.apply_chat_template(converted, tokenize=True, **kwargs)
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


class ScriptedEngine:
    """Answers each request with the next scripted text, as the engine streams it."""

    model_name = "scripted"
    vocab_size = 320
    max_context_len = 4096

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.answers: list[str] = []
        self.prompts: list[list[int]] = []

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if not self.answers:
            raise RequestError("no scripted answer left")
        self.prompts.append(list(request.input_ids))
        ids = [*self.tokenizer.encode(self.answers.pop(0), add_special_tokens=False), IM_END]
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.input_ids)
        n = len(request.input_ids)
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            text = "" if last else detokenizer.push(token)
            if i == len(ids) - 2:
                text += detokenizer.flush()
            yield GenerateOutput(request.rid, (token,), text, last, "stop" if last else None,
                                 n, i + 1, CachedTokens(), ttft_s=0.0 if last else None,
                                 latency_s=0.0 if last else None)

    def abort(self, rid: str) -> None:
        pass

    def flush_cache(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {}

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        pass

    def detach_storage(self) -> None:
        pass

    def storage_status(self) -> dict[str, Any]:
        return {"attached": False, "error": None}


@pytest.fixture(scope="module")
def scripted(model_dir: Path) -> Iterator[tuple[ScriptedEngine, openai.OpenAI]]:
    engine = ScriptedEngine(HFTokenizer.from_dir(model_dir, extra_eos_token_ids=[IM_END]))
    with serve_app_in_thread(create_app(engine, served_model_name="qwen-style")) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                          timeout=30.0) as client:
        yield engine, client


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_replays_a_tool_using_conversation(
    scripted: tuple[ScriptedEngine, openai.OpenAI], reference: PreTrainedTokenizerBase,
    stream: bool,
) -> None:
    engine, client = scripted
    engine.answers = ["Let me look that up.\n" + CALL_ANSWER, FINAL_ANSWER]
    messages: list[dict[str, Any]] = list(QUESTION)
    if stream:
        content, calls, reason = "", {}, None
        for chunk in client.chat.completions.create(
            model="qwen-style", messages=cast(Any, messages), tools=cast(Any, TOOLS),
            stream=True,
        ):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                calls[call.index] = call
            reason = chunk.choices[0].finish_reason or reason
        assert content == "Let me look that up."
        assert reason == "tool_calls" and len(calls) == 1
        call = calls[0]
        assert call.function is not None and call.id is not None
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
        assistant: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]}
    else:
        first = client.chat.completions.create(
            model="qwen-style", messages=cast(Any, messages), tools=cast(Any, TOOLS),
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look that up."
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        tool_call = choice.message.tool_calls[0]
        assert tool_call.type == "function"
        name, arguments, call_id = (tool_call.function.name, tool_call.function.arguments,
                                    tool_call.id)
        assistant = choice.message.model_dump(exclude_none=True)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Zürich"}
    assert engine.prompts[-1] == reference_ids(reference, messages, tools=TOOLS,
                                               add_generation_prompt=True)

    # The agent runs the tool and sends the whole conversation back.
    messages += [assistant, {"role": "tool", "tool_call_id": call_id,
                             "content": '{"temperature_c": 21}'}]
    second = client.chat.completions.create(
        model="qwen-style", messages=cast(Any, messages), tools=cast(Any, TOOLS),
    )
    assert second.choices[0].message.content == FINAL_ANSWER
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    expected = reference_ids(reference, messages, tools=TOOLS, add_generation_prompt=True)
    assert engine.prompts[-1] == expected
    text = reference.decode(expected)
    assert "<tool_response>" in text and '"arguments": {"city": "Zürich"}' in text


def test_template_variables_and_continuing_a_message(
    scripted: tuple[ScriptedEngine, openai.OpenAI], reference: PreTrainedTokenizerBase,
) -> None:
    engine, client = scripted
    engine.answers = ["fine", "fine", "fine"]
    messages: list[dict[str, Any]] = list(QUESTION)
    client.chat.completions.create(
        model="qwen-style", messages=cast(Any, messages),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    no_think = reference_ids(reference, messages, add_generation_prompt=True,
                             enable_thinking=False)
    assert engine.prompts[-1] == no_think
    assert "<think>" in reference.decode(no_think)

    partial = [*messages, {"role": "assistant", "content": "The weather in Zürich is "}]
    client.chat.completions.create(
        model="qwen-style", messages=cast(Any, partial),
        extra_body={"continue_final_message": True},
    )
    assert engine.prompts[-1] == reference_ids(reference, partial, continue_final_message=True)
    prompt = reference.decode(engine.prompts[-1])
    assert prompt.endswith("<|im_start|>assistantThe weather in Zürich is ")

    # tool_choice "none": the tools are not shown, and the answer is not parsed.
    engine.answers = [CALL_ANSWER]
    plain = client.chat.completions.create(
        model="qwen-style", messages=cast(Any, messages), tools=cast(Any, TOOLS),
        tool_choice="none",
    )
    assert engine.prompts[-1] == reference_ids(reference, messages, add_generation_prompt=True)
    assert plain.choices[0].message.content == CALL_ANSWER
    assert plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set"),
        ({"continue_final_message": True}, "needs an assistant message last"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
         "arguments is not JSON"),
    ],
)
def test_bad_tool_conversations_are_400s(
    scripted: tuple[ScriptedEngine, openai.OpenAI], extra: dict[str, Any], words: str
) -> None:
    _, client = scripted
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(
            model="qwen-style", messages=cast(Any, QUESTION), extra_body=extra,
        )


@pytest.fixture(scope="module")
def real_server(model_dir: Path) -> Iterator[RunningServer]:
    with serve_in_thread(["--model-path", str(model_dir), "--load-format", "dummy"]) as running:
        yield running


def test_real_engine_takes_the_same_conversation(
    real_server: RunningServer, reference: PreTrainedTokenizerBase
) -> None:
    messages: list[dict[str, Any]] = [*QUESTION, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}],
    }, {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0,
                       timeout=30.0) as client:
        answer = client.chat.completions.create(
            model=real_server.engine.model_name, messages=cast(Any, messages),
            tools=cast(Any, TOOLS), max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
        )
    expected = reference_ids(reference, messages, tools=TOOLS, add_generation_prompt=True,
                             enable_thinking=False)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)
    assert answer.choices[0].finish_reason in ("length", "tool_calls", "stop")


@pytest.mark.parametrize("content", ["Sure, the answer is ", "Sure", "  padded  "])
def test_continue_final_message_as_transformers_with_a_trimming_template(
    tmp_path: Path, content: str
) -> None:
    # test_hf_tokenizer's template trims each message: the prompt must end trimmed too.
    write_tokenizer(tmp_path)
    ours = HFTokenizer.from_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [*QUESTION[1:], {"role": "assistant", "content": content}]
    text = continue_final_message(
        lambda marked: ours.apply_chat_template(marked, add_generation_prompt=False), messages
    )
    assert text == reference.apply_chat_template(
        messages, tokenize=False, continue_final_message=True
    )
