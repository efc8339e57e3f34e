"""Message content as agents send it, through the official OpenAI client: lists of text parts,
null or absent content on assistant messages with tool calls, tool results as parts.

Each conversation's prompt is compared token for token with transformers'
``apply_chat_template`` given the content the rule of ``hicache.tokenizer.chat_content``
describes: SmolLM2's template (it concatenates strings) gets the parts' text joined by
a newline, a template that iterates over parts gets the list, null content is "".
Non-text parts and messages that OpenAI requires content of are 400s naming what is wrong.
A real engine (dummy weights) serves the same conversation.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hicache.model.presets import get_preset
from hicache.server.app import create_app
from hicache.tokenizer.chat_content import TEXT_PART_SEPARATOR
from hicache.tokenizer.hf import HFTokenizer
from tests.integration.server.test_chat_tools import IM_END, ScriptedEngine
from tests.server_fixtures import serve_app_in_thread, serve_in_thread
from tests.unit.model.test_hf_tokenizer import write_tokenizer

# SmolLM2-135M-Instruct's template, as its GGUF file and tokenizer_config.json carry it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Written as vision models' templates are: content a string or a list of parts.
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "[{{ part['text'] }}]{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {"smollm2": SMOLLM2_TEMPLATE, "parts": PARTS_TEMPLATE}

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# An agent loop's second turn, as the OpenAI SDK and LangChain send it.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                 {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21 C"}]},
    {"role": "assistant", "tool_calls": [CALL]},  # content left out altogether
    {"role": "tool", "tool_call_id": "call_1", "content": "still 21 C"},
    {"role": "user", "content": "Thanks."},
]


def shaped(messages: list[dict[str, Any]], takes_parts: bool) -> list[dict[str, Any]]:
    """The content each template is given: parts kept or joined, null as ""."""
    out = []
    for message in json.loads(json.dumps(messages)):
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list) and not takes_parts:
            message["content"] = TEXT_PART_SEPARATOR.join(p["text"] for p in content)
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def make_model_dir(path: Path, template: str) -> Path:
    write_tokenizer(path, chat_template=template)
    config = dataclasses.replace(get_preset("tiny"), vocab_size=320)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, IM_END]}))
    return path


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ScriptedEngine, openai.OpenAI, PreTrainedTokenizerBase]]:
    name = request.param
    model_dir = make_model_dir(tmp_path_factory.mktemp(name), TEMPLATES[name])
    engine = ScriptedEngine(HFTokenizer.from_dir(model_dir, extra_eos_token_ids=[IM_END]))
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    with serve_app_in_thread(create_app(engine, served_model_name=name)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                          timeout=30.0) as client:
        yield name, engine, client, reference


def reference_ids(reference: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    encoded = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def test_parts_and_null_content_render_as_the_template_expects(
    served: tuple[str, ScriptedEngine, openai.OpenAI, PreTrainedTokenizerBase],
) -> None:
    name, engine, client, reference = served
    engine.answers = ["It is 21 C."]
    reply = client.chat.completions.create(model=name, messages=cast(Any, CONVERSATION))
    assert reply.choices[0].message.content == "It is 21 C."
    takes_parts = name == "parts"
    expected = reference_ids(reference, shaped(CONVERSATION, takes_parts))
    assert engine.prompts[-1] == expected
    text = reference.decode(expected)
    if takes_parts:  # the template wrote each part itself
        assert "[What is the weather][in Paris?]" in text and "[21 C]" in text
    else:
        assert "What is the weather\nin Paris?" in text and "\n21 C<|im_end|>" in text
        # SmolLM2's template writes the assistant turns, empty, and ignores tool calls.
        assert text.count("<|im_start|>assistant\n<|im_end|>") == 2


def test_the_clients_own_reply_object_goes_back_as_it_is(
    served: tuple[str, ScriptedEngine, openai.OpenAI, PreTrainedTokenizerBase],
) -> None:
    """The commonest agent loop appends the reply's message object itself to the next
    request: the SDK then sends its ``refusal: null`` (and with newer replies
    ``annotations``, ``audio``, ``function_call`` at their empty values) beside the content."""
    name, engine, client, reference = served
    engine.answers = ["It is 21 C.", "You are welcome."]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=name, messages=messages)
    echoed = first.choices[0].message
    assert echoed.refusal is None  # the SDK sends it back as null
    messages += [echoed, {"role": "user", "content": "Thanks."}]
    second = client.chat.completions.create(model=name, messages=messages)
    assert second.choices[0].message.content == "You are welcome."
    expected = reference_ids(reference, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "It is 21 C."},
        {"role": "user", "content": "Thanks."},
    ])
    assert engine.prompts[-1] == expected
    # The empty forms of the other reply fields, as raw JSON.
    engine.answers = ["Fine."]
    raw = [*messages[:1], {"role": "assistant", "content": "It is 21 C.", "refusal": None,
                           "annotations": [], "audio": None, "function_call": None},
           messages[2]]
    client.chat.completions.create(model=name, messages=cast(Any, raw))
    assert engine.prompts[-1] == expected


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
         "messages.0.content.1 is a content part of type 'image_url'"),
        ([{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
         "type 'input_audio'"),
        ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}],
         "type 'file'"),
        ([{"role": "user", "content": [{"type": "text"}]}],
         "messages.0.content.0 is a text part without a 'text' string"),
        ([{"role": "user", "content": None}], "messages.0.content is missing or null"),
        ([{"role": "user"}], "a user message needs content"),
        ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
         "a system message needs content"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                               "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_1"}], "a tool message needs content"),
    ],
    ids=["image", "audio", "file", "text-without-text", "user-null", "user-missing",
         "system-null", "tool-missing"],
)
def test_content_the_server_cannot_take_is_a_400_naming_it(
    served: tuple[str, ScriptedEngine, openai.OpenAI, PreTrainedTokenizerBase],
    messages: list[dict[str, Any]], words: str,
) -> None:
    name, engine, client, _ = served
    prompts = len(engine.prompts)
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=name, messages=cast(Any, messages))
    assert len(engine.prompts) == prompts  # nothing reached the engine


def test_a_real_engine_serves_parts_to_smollm2s_template(
    tmp_path: Path,
) -> None:
    model_dir = make_model_dir(tmp_path / "smollm2", SMOLLM2_TEMPLATE)
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    with serve_in_thread(["--model-path", str(model_dir), "--load-format", "dummy"]) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                          timeout=60.0) as client:
        reply = client.chat.completions.create(
            model=str(model_dir), messages=cast(Any, CONVERSATION), max_tokens=4,
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(reference_ids(reference, shaped(CONVERSATION, False)))
    assert reply.choices[0].finish_reason in ("length", "stop")
