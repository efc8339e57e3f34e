"""Small GGUF files written in the test, as llama.cpp's converter would write them.

``write_gguf`` takes a transformers model (``hf_checkpoints.build_hf_model``)
and writes it with the ``gguf`` package's writer: llama.cpp's metadata keys and
tensor names, Llama's q/k rows in llama.cpp's order, matrices quantized (Q8_0
by default) and the rest in F32, and a byte-level BPE tokenizer (the 256 byte
tokens, a few merges, ChatML specials). transformers loading the file on its own
is the reference for what the file means.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel

from tests.hf_checkpoints import VOCAB

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS_ID = VOCAB - 4  # <|endoftext|>
EOS_ID = VOCAB - 3  # <|im_end|>
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ARCH_NAMES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types: bytes, merged pairs, then the specials (VOCAB in all)."""
    tokens = byte_alphabet()
    merges: list[str] = []
    space = tokens[ord(" ")]
    words = ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te"]
    pieces = [*words, *(space + c for c in "tahswiobmfcdlpnrge"),
              *("12", "34", "ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv",
                "wx", "yz", "AB", "CD", "EF", "GH", "IJ", "KL", "MN", "OP", "QR", "ST", "UV",
                "WX", "YZ")]
    for piece in pieces[: VOCAB - 256 - len(SPECIALS)]:
        merges.append(f"{piece[0]} {piece[1]}")
        tokens.append(piece)
    tokens += SPECIALS
    types = [1] * (VOCAB - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
    assert len(tokens) == VOCAB, len(tokens)
    return tokens, merges, types


def _llama_cpp_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k reordering: half-split pairs -> interleaved pairs."""
    head_dim = rows.shape[0] // num_heads
    split = rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def write_gguf(
    model: PreTrainedModel, path: Path, *, pre: str = "qwen2",
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
    edit: Callable[[gguf.GGUFWriter], None] | None = None,
    tokenizer_model: str = "gpt2", arch: str | None = None,
    raw_types: dict[str, type[np.floating[Any]]] | None = None, add_bos: bool = False,
) -> Path:
    """Write ``model`` as a GGUF file at ``path``; ``edit`` may add or change metadata;
    ``raw_types`` writes the named tensors unquantized in the given numpy float type."""
    config: Any = model.config
    arch = arch or _ARCH_NAMES[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens, merges, types = bpe_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    if edit is not None:
        edit(writer)

    for name, param in model.state_dict().items():
        values = param.detach().to(torch.float32).numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = (config.num_attention_heads if ".attn_q." in gguf_name
                     else config.num_key_value_heads)
            values = _llama_cpp_rows(values, heads)
        if raw_types and gguf_name in raw_types:
            writer.add_tensor(gguf_name, values.astype(raw_types[gguf_name]))
        elif values.ndim == 2 and quant is not gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_PARTS[part]}.{kind}"
