"""A model dir's tokenizer.json and chat template behave as transformers' tokenizer of that dir.

The tokenizer is trained in the test with the ``tokenizers`` library (byte-level
BPE, so characters span several tokens), saved as tokenizer.json with a
tokenizer_config.json holding special tokens and a ChatML-style template.
transformers' ``AutoTokenizer`` of the same dir is the reference for ids,
decoded text and rendered prompts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hicache.model.errors import ModelConfigError
from hicache.model.loader import load_model
from hicache.model.presets import get_preset
from hicache.tokenizer.base import TokenizerError
from hicache.tokenizer.detokenizer import IncrementalDetokenizer
from hicache.tokenizer.hf import HFTokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "a tokenizer splits text into tokens; the model predicts the next one",
    "héllo wörld, ça va? 中文 文本 😀 🚀",
] * 10
# Real templates look like this: a system turn first if any, roles checked, tools as JSON.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "hello world",
    "  leading and trailing spaces  ",
    "lines\nand\ttabs\n\n",
    "héllo wörld, ça va?",
    "中文 文本",
    "emoji 😀🚀 and more",
    "",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  what is 中文?  "},
        {"role": "assistant", "content": "Chinese."},
        {"role": "user", "content": "thanks 😀"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "find <things> & ünïcode",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _added_token(content: str) -> dict[str, Any]:
    # How transformers writes special tokens in tokenizer_config.json.
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }


def write_tokenizer(path: Path, chat_template: str | None = TEMPLATE) -> FastTokenizer:
    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # BOS in front of every encoding that asks for special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": _added_token("</s>"),
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def ours(tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_as_transformers(
    ours: HFTokenizer, reference: PreTrainedTokenizerBase, text: str
) -> None:
    ids = ours.encode(text)
    plain = ours.encode(text, add_special_tokens=False)
    assert ids == [ours.bos_token_id, *plain]
    assert ids == reference(text).input_ids
    assert plain == reference(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == text  # BOS skipped
    assert ours.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_long_texts_encode_and_decode_as_transformers(
    ours: HFTokenizer, reference: PreTrainedTokenizerBase
) -> None:
    """Long inputs take the batch calls (which let other threads run): same ids, same text,
    special tokens inside the text included."""
    text = "".join(TEXTS) + "<|im_start|>user\nhi<|im_end|>" + " ".join(CORPUS) * 20
    ids = ours.encode(text)
    assert len(ids) > 4096
    assert ids == reference(text).input_ids
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_characters_span_several_tokens(ours: HFTokenizer) -> None:
    """What makes streaming detokenization hard is really there."""
    ids = ours.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    assert "\ufffd" in ours.decode(ids[:1])


def test_special_tokens(ours: HFTokenizer, reference: PreTrainedTokenizerBase) -> None:
    assert ours.bos_token_id == reference.bos_token_id == 0
    assert ours.eos_token_ids == (reference.eos_token_id,) == (1,)
    assert ours.vocab_size == 300
    # Ids past the vocabulary (models pad theirs) decode to nothing.
    assert ours.decode([*ours.encode("hi", add_special_tokens=False), 300, 5000]) == "hi"


@pytest.mark.parametrize("generation_prompt", [True, False], ids=["open-reply", "closed"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user-only", "multi-turn"])
def test_chat_template_renders_as_transformers(
    ours: HFTokenizer,
    reference: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    generation_prompt: bool,
) -> None:
    text = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert text == expected
    assert text.startswith("<s><|im_start|>")
    assert text.endswith("<|im_start|>assistant\n") == generation_prompt
    # Token ids: the template writes BOS as text, so none is added on top.
    encoded = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=generation_prompt
    )
    ids = encoded if isinstance(encoded, list) else encoded["input_ids"]  # v4: a list
    assert ours.encode_chat(conversation, add_generation_prompt=generation_prompt) == ids
    assert ids.count(ours.bos_token_id) == 1


def test_tools_reach_the_template_as_json(
    ours: HFTokenizer, reference: PreTrainedTokenizerBase
) -> None:
    conversation = CONVERSATIONS[0]
    text = ours.apply_chat_template(conversation, add_generation_prompt=True, tools=TOOLS)
    expected = reference.apply_chat_template(
        conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert '"find <things> & ünïcode"' in text  # not HTML-escaped, not ASCII-escaped


def test_template_refusals_are_tokenizer_errors(ours: HFTokenizer) -> None:
    with pytest.raises(TokenizerError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="system message must come first"):
        ours.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


def test_template_from_chat_template_jinja(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, chat_template=None)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_or_broken_templates(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "none", chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        HFTokenizer.from_dir(tmp_path / "none").apply_chat_template(
            [{"role": "user", "content": "x"}]
        )
    write_tokenizer(tmp_path / "broken", chat_template="{% for m in messages %}unclosed")
    with pytest.raises(TokenizerError, match="does not compile"):
        HFTokenizer.from_dir(tmp_path / "broken")


def test_unusable_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        HFTokenizer.from_dir(tmp_path)
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = "<bos-that-is-not-there>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="not in the tokenizer's vocabulary"):
        HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", ["héllo wörld, ça va? 中文 文本 😀 🚀 done", "plain ascii text"])
def test_streaming_detokenization_equals_full_decode(ours: HFTokenizer, text: str) -> None:
    prompt = ours.encode("the prompt")
    ids = ours.encode(text, add_special_tokens=False)
    stream = IncrementalDetokenizer(ours, prompt_ids=prompt)
    deltas = [stream.push(token) for token in ids]
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    assert "".join(deltas) + stream.flush() == text == stream.text
    assert sum(1 for d in deltas if d) > len(text.split()) // 2  # it really streams


def _model_dir(path: Path, vocab_size: int) -> Path:
    config = dataclasses.replace(get_preset("tiny"), vocab_size=vocab_size)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return path


def test_load_model_uses_the_dirs_tokenizer_and_stop_ids(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    _model_dir(tmp_path, vocab_size=320)
    im_end = SPECIALS.index("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, im_end]}))
    loaded = load_model(tmp_path, "dummy")
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.eos_token_ids == (1, im_end)  # tokenizer's, then generation's
    assert loaded.tokenizer.encode("hi") == HFTokenizer.from_dir(tmp_path).encode("hi")


def test_tokenizer_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    _model_dir(tmp_path, vocab_size=256)
    with pytest.raises(ModelConfigError, match="300 tokens but the model only 256"):
        load_model(tmp_path, "dummy")
