"""GGUF files of each supported architecture load as transformers reads them; the rest is refused.

Small random models (Llama with llama.cpp's q/k row order and an untied
output, Qwen2 with q/k/v biases, Qwen3 with q/k norms and tied embeddings) are
written as GGUF files in the test with quantized matrices (Q8_0, Q4_0, F16).
transformers reads each file on its own; our converted model's logits must be
its logits. The tokenizer each ``tokenizer.ggml.pre`` selects splits text as
transformers' does where both follow llama.cpp. Conversions are atomic: a
failed one leaves nothing that a later load would use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from hicache.config import ConfigError
from hicache.model import gguf_cache
from hicache.model.config import Architecture
from hicache.model.gguf_cache import SOURCE_FILE, gguf_model_name, prepare_gguf
from hicache.model.loader import load_model
from hicache.model.safetensors_writer import SafetensorsWriter
from tests.gguf_checkpoints import BOS_ID, EOS_ID, write_gguf
from tests.hf_checkpoints import _COMMON, VOCAB, build_hf_model, hf_logits, variants
from tests.model_scenarios import SlotAllocator, new_pool, random_tokens, run_in_steps

Q = gguf.GGMLQuantizationType
PROMPT_LEN = 21
TEXTS = ["hello the world", "In 1234 there were 56 cats!", "  two  spaces\nand\ttabs ",
         "héllo wörld 中文 😀", "<|im_start|>user\nhi<|im_end|>"]


def _cases() -> dict[str, tuple[Any, Q]]:
    chosen = variants()
    return {
        "llama-gqa-q8_0": (chosen["llama-gqa"], Q.Q8_0),
        "qwen2-bias-q4_0": (chosen["qwen2-qkv-bias"], Q.Q4_0),
        # transformers' GGUF reader takes Qwen3's head_dim from its default (128), so this
        # model has that head_dim (wider than hidden_size / heads, as Qwen3's often is).
        "qwen3-qknorm-tied-f16": (
            Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                        tie_word_embeddings=True),
            Q.F16,
        ),
    }


CASES = _cases()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hicache-cache"
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_hf_model(variants()["llama-gqa"])


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_reading_the_same_file(case: str, tmp_path: Path) -> None:
    config, quant = CASES[case]
    path = write_gguf(build_hf_model(config), tmp_path / f"{case}.gguf", quant=quant)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    loaded = load_model(path, "auto", None, "float32", "cpu")
    ours = loaded.model
    assert ours.config.architecture is Architecture(type(reference).__name__)
    assert ours.config.tie_word_embeddings == config.tie_word_embeddings
    ref_config: Any = reference.config
    hf_head_dim = getattr(ref_config, "head_dim", None)  # Qwen2's config has none
    assert ours.config.head_dim == (hf_head_dim or
                                    ref_config.hidden_size // ref_config.num_attention_heads)
    assert loaded.tokenizer.eos_token_ids == (EOS_ID,)

    prompt = random_tokens(PROMPT_LEN, VOCAB, seed=1)
    pool = new_pool(ours, page_size=4)
    got = run_in_steps(ours, pool, prompt, SlotAllocator(pool).slots(PROMPT_LEN), [PROMPT_LEN])
    expected = hf_logits(reference, prompt)
    assert expected.std() > 0.3
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("pre", "add_bos"), [("qwen2", False), ("llama-bpe", True), ("gpt2", False)]
)
def test_tokenizer_splits_text_as_transformers(
    pre: str, add_bos: bool, llama: Any, tmp_path: Path
) -> None:
    path = write_gguf(llama, tmp_path / "m.gguf", pre=pre, add_bos=add_bos)
    expected = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = load_model(path, "auto", None, "float32", "cpu").tokenizer
    assert (ours.encode("hi")[0] == BOS_ID) is add_bos
    assert ours.encode("hi", add_special_tokens=False)[0] != BOS_ID
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == expected(text)["input_ids"], text
        assert ours.decode(ids) == expected.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == expected.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_smollm_pre_tokenizer_keeps_digits_apart_as_llama_cpp_does(
    llama: Any, tmp_path: Path
) -> None:
    """llama.cpp splits every digit off before BPE for the StarCoder/SmolLM family, so the
    merge "1 2" of this vocabulary never applies (transformers reads this file as plain
    GPT-2 and would merge it: there we follow llama.cpp, which the models were made for)."""
    path = write_gguf(llama, tmp_path / "m.gguf", pre="smollm")
    tokenizer = load_model(path, "auto", None, "float32", "cpu").tokenizer
    assert tokenizer.encode("12") == [ord("1"), ord("2")]
    gpt2 = load_model(write_gguf(llama, tmp_path / "g.gguf", pre="gpt2"), "auto", None,
                      "float32", "cpu").tokenizer
    assert len(gpt2.encode("12")) == 1


def _set(key: str, value: str) -> Any:
    return lambda writer: writer.add_string(key, value)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"arch": "phi3"}, "architecture 'phi3' is not supported"),
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
        ({"pre": "jais"}, "tokenizer.ggml.pre 'jais' is not supported"),
        ({"edit": _set("llama.rope.scaling.type", "linear")}, "RoPE scaling 'linear'"),
        ({"raw_types": {"token_embd.weight": np.float64}},
         "token_embd.weight has type F64, which the gguf package cannot dequantize"),
    ],
    ids=["architecture", "tokenizer-model", "pre-tokenizer", "rope-scaling", "tensor-type"],
)
def test_unsupported_files_are_refused_and_leave_nothing(
    options: dict[str, Any], words: str, llama: Any, tmp_path: Path, cache_dir: Path
) -> None:
    path = write_gguf(llama, tmp_path / "m.gguf", **options)
    with pytest.raises(ConfigError, match=words):
        load_model(path, "auto", None, "float32", "cpu")
    assert not any((cache_dir / "models").iterdir())


def test_an_interrupted_conversion_is_never_loaded(
    llama: Any, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(llama, tmp_path / "m.gguf")
    write = SafetensorsWriter.write
    written: list[str] = []

    def dies_at_the_third(self: SafetensorsWriter, name: str, tensor: torch.Tensor) -> None:
        if len(written) == 2:
            raise KeyboardInterrupt  # Ctrl-C mid-conversion
        written.append(name)
        write(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare_gguf(path, torch.float32)
    assert not any((cache_dir / "models").iterdir())  # no target, no temporary

    monkeypatch.setattr(SafetensorsWriter, "write", write)
    converted = prepare_gguf(path, torch.float32)
    assert converted.converted and (converted.path / SOURCE_FILE).is_file()
    assert load_model(path, "auto", None, "float32", "cpu").config.num_layers == 2


def test_leftovers_of_dead_conversions_are_removed(
    llama: Any, tmp_path: Path, cache_dir: Path
) -> None:
    path = write_gguf(llama, tmp_path / "m.gguf")
    first = prepare_gguf(path, torch.float32)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    leftover = first.path.parent / f".tmp-{first.path.name}-{gguf_cache._HOST_TAG}-{pid}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    # A live process's temporary (this one's parent: surely running) stays.
    live = first.path.parent / f".tmp-{first.path.name}-{gguf_cache._HOST_TAG}-{os.getppid()}"
    live.mkdir()
    for name in os.listdir(first.path):
        (first.path / name).unlink()
    first.path.rmdir()

    again = prepare_gguf(path, torch.float32)
    assert again.converted and again.path == first.path
    assert not leftover.exists()
    assert live.exists()


@pytest.mark.parametrize(
    ("file_name", "model_name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
        ("Qwen3-0.6B-BF16.gguf", "Qwen3-0.6B"),
        ("qwen2.5-0.5b-instruct-iq4_xs.gguf", "qwen2.5-0.5b-instruct"),
        ("model.gguf", "model"),
    ],
)
def test_model_name_drops_the_quantization_tag(file_name: str, model_name: str) -> None:
    assert gguf_model_name(file_name) == model_name


def test_a_dir_without_the_final_file_is_converted_again(llama: Any, tmp_path: Path) -> None:
    path = write_gguf(llama, tmp_path / "m.gguf")
    first = prepare_gguf(path, torch.float32)
    (first.path / SOURCE_FILE).unlink()  # as if emptied by hand, or never finished
    (first.path / "model.safetensors").write_bytes(b"junk")
    again = prepare_gguf(path, torch.float32)
    assert again.converted and again.path == first.path
    assert load_model(path, "auto", None, "float32", "cpu").config.num_layers == 2
