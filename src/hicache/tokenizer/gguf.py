"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` tokenizer.json.

GGUF stores a tokenizer as metadata: ``tokenizer.ggml.model`` (its kind), the
tokens, their types, the BPE merges, ``tokenizer.ggml.pre`` (which text
splitting llama.cpp applies before BPE), the special token ids and the chat
template. ``GGUFTokenizerFiles.from_metadata`` turns that into the three files a
Hugging Face model dir has (tokenizer.json, tokenizer_config.json with the chat
template, generation_config.json with the stop ids), so the ordinary
``HFTokenizer`` loads it.

Supported: ``tokenizer.ggml.model = "gpt2"``, byte-level BPE (GPT-2, SmolLM,
Llama-3, Qwen2/Qwen3), with the pre-tokenizers in ``PRE_TOKENIZERS``. Every other
tokenizer model (SentencePiece ``llama``, ``t5``, ``bert``, ``rwkv``...) and
every other pre-tokenizer is refused with a message saying so: a tokenizer that
splits text differently from the one the model was trained with gives it
token sequences it has never seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.model.errors import GGUFError

SUPPORTED_TOKENIZER_MODEL = "gpt2"

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3  # <|im_start|>, <|endoftext|>: special, matched whole in text, skipped on decode
_USER_DEFINED = 4  # added tokens matched whole in text, decoded as text

# Splitting regexes of the byte-level BPE families, as llama.cpp applies them.
_DIGITS_ALONE = r"\p{N}"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """A regex that isolates pieces first (or None), then byte-level splitting: with
    ``gpt2_regex`` GPT-2's own word regex, else bytes only."""

    split: str | None
    gpt2_regex: bool


_GPT2 = _PreTokenizer(None, gpt2_regex=True)
_DIGITS_THEN_GPT2 = _PreTokenizer(_DIGITS_ALONE, gpt2_regex=True)
_LLAMA3 = _PreTokenizer(_LLAMA3_SPLIT, gpt2_regex=False)
_QWEN2 = _PreTokenizer(_QWEN2_SPLIT, gpt2_regex=False)

# tokenizer.ggml.pre -> how llama.cpp splits text for it.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    # Every digit alone, then GPT-2's regex (the StarCoder family, SmolLM).
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


@dataclass(frozen=True)
class GGUFTokenizerFiles:
    """What a model dir's tokenizer files hold, built from GGUF metadata."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GGUFTokenizerFiles:
        from tokenizers import AddedToken, Tokenizer, decoders, models

        kind = metadata.get("tokenizer.ggml.model")
        if kind != SUPPORTED_TOKENIZER_MODEL:
            raise GGUFError(
                f"tokenizer.ggml.model {kind!r} is not supported; supported: "
                f"{SUPPORTED_TOKENIZER_MODEL!r} (byte-level BPE, as GPT-2, SmolLM, Llama-3 "
                "and Qwen use)"
            )
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(
                f"tokenizer.ggml.pre {pre!r} is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tokens: list[str] = list(_required(metadata, "tokenizer.ggml.tokens"))
        merges: list[str] = list(_required(metadata, "tokenizer.ggml.merges"))
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])

        tok = Tokenizer(models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=[_merge_pair(merge) for merge in merges],
            fuse_unk=False,
        ))
        tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
        tok.decoder = decoders.ByteLevel()
        # Added tokens are already in the vocabulary: adding them keeps their ids and makes
        # the tokenizer match them whole in text.
        tok.add_special_tokens([
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind_id in enumerate(types) if kind_id == _CONTROL
        ])
        tok.add_tokens([
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind_id in enumerate(types) if kind_id == _USER_DEFINED
        ])
        bos_id = _token_id(metadata, "bos", len(tokens))
        eos_id = _token_id(metadata, "eos", len(tokens))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos_id is None) or (add_eos and eos_id is None):
            raise GGUFError("the GGUF asks to add a BOS or EOS token but names none")
        around = _bos_eos_template(
            tokens, bos_id if add_bos else None, eos_id if add_eos else None
        )
        if around is not None:
            tok.post_processor = around

        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": add_bos,
            "add_eos_token": add_eos,
            "bos_token": tokens[bos_id] if bos_id is not None else None,
            "eos_token": tokens[eos_id] if eos_id is not None else None,
        }
        chat_template = metadata.get("tokenizer.chat_template")
        if isinstance(chat_template, str):
            config["chat_template"] = chat_template
        # Instruct models end a turn with an end-of-turn token that may differ from EOS.
        stop_ids = [
            i
            for i in (eos_id, _token_id(metadata, "eot", len(tokens)),
                      _token_id(metadata, "eom", len(tokens)))
            if i is not None
        ]
        generation = {"bos_token_id": bos_id, "eos_token_id": list(dict.fromkeys(stop_ids))}
        return cls(tok.to_str(), config, generation)


def _pre_tokenizer(how: _PreTokenizer) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=how.gpt2_regex)
    if how.split is None:
        return byte_level
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(how.split), behavior="isolated"), byte_level]
    )


def _bos_eos_template(tokens: list[str], bos_id: int | None, eos_id: int | None) -> Any:
    """The post-processor adding BOS before / EOS after every text, or None for neither."""
    from tokenizers.processors import TemplateProcessing

    if bos_id is None and eos_id is None:
        return None
    # tokenizers' template syntax: "<s>:0 $A:0" puts <s> before the text (sequence 0).
    pieces = [
        *([f"{tokens[bos_id]}:0"] if bos_id is not None else []),
        "$A:0",
        *([f"{tokens[eos_id]}:0"] if eos_id is not None else []),
    ]
    ids = [i for i in (bos_id, eos_id) if i is not None]
    return TemplateProcessing(single=" ".join(pieces), special_tokens=[(tokens[i], i) for i in ids])


def _merge_pair(merge: str) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not space:
        raise GGUFError(f"tokenizer.ggml.merges: {merge!r} is not two tokens")
    return left, right


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"the GGUF metadata has no {key!r}, which a BPE tokenizer needs")
    return metadata[key]


def _token_id(metadata: Mapping[str, Any], which: str, vocab_size: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{which}_token_id")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise GGUFError(f"tokenizer.ggml.{which}_token_id {value!r} is not in the vocabulary")
    return value
