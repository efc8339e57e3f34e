"""The byte-level tokenizer written as a Hugging Face tokenizer dir, for clients.

A dummy model is served with ``ByteTokenizer`` (UTF-8 bytes 0-255, then its
specials), which has no files. Benchmark clients such as SGLang's
``bench_serving`` and ``bench_multiturn.py`` load a tokenizer with transformers'
``AutoTokenizer`` from the path the server advertises (``/model_info``'s
``tokenizer_path``) to size prompts and count tokens; this dir lets them load
one that gives exactly the server's ids. It holds tokenizer.json (a byte-level
BPE with no merges: one token per byte, ids 0-255, the specials after) and
tokenizer_config.json (the specials and the same chat format as a Jinja
template). It is written once under ``$HICACHE_CACHE_DIR/tokenizers/`` by
renaming a finished temporary dir, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hicache.local_cache import local_cache_dir
from hicache.tokenizer.byte_level import ByteTokenizer

# Bump when the files change, so an older dir is not reused.
BYTE_TOKENIZER_DIR_NAME = "byte-level-v1"

# ByteTokenizer.apply_chat_template as Jinja: <|bos|>, <|role|>content<|end|> per
# message, then <|assistant|> to open the reply.
CHAT_TEMPLATE = (
    "<|bos|>{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """For each byte 0-255, the printable character byte-level BPE writes it as.

    Printable Latin-1 bytes stand for themselves; the others (controls, space,
    the non-breaking space and soft hyphen) are given the characters from U+0100
    on, in byte order. This is the mapping the ``tokenizers`` ByteLevel
    pre-tokenizer and decoder apply, so the vocabulary must be keyed by it.
    """
    kept = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    alphabet: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in kept:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def tokenizer_json() -> dict[str, Any]:
    """tokenizer.json of the byte-level tokenizer (ids as ``ByteTokenizer`` gives them)."""
    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    added = [
        {"id": 256 + i, "content": text, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, text in enumerate(ByteTokenizer.SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        # Every byte of the text becomes one character, with no splitting on words.
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        # <|bos|> first, as ByteTokenizer.encode(add_special_tokens=True) does.
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [256], "tokens": ["<|bos|>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
    }


def byte_tokenizer_dir(root: Path | None = None) -> Path:
    """The dir (made if missing) under ``root`` (default: the local cache's tokenizers/)."""
    parent = root if root is not None else local_cache_dir() / "tokenizers"
    target = parent / BYTE_TOKENIZER_DIR_NAME
    if (target / "tokenizer.json").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BYTE_TOKENIZER_DIR_NAME}-", dir=parent))
    try:
        (staging / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))
        try:
            os.rename(staging, target)
        except OSError:
            # Another server wrote it first (the rename onto a non-empty dir fails): use theirs.
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
