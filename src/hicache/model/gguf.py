"""GGUF files (llama.cpp's format): the model config and the weights they hold.

A GGUF file carries the model's shape as metadata under llama.cpp's key names
(``llama.block_count``, ``llama.attention.head_count`` ...), every weight under
llama.cpp's tensor names (``blk.3.attn_q.weight``), most of them quantized in
blocks, and the tokenizer (see ``hicache.tokenizer.gguf``). ``GGUFModel`` reads one
and hands out what our model-dir loader understands: a ``ModelConfig`` and each
weight dequantized to float32 under its Hugging Face name and layout.

Supported: the ``llama``, ``qwen2`` and ``qwen3`` architectures (dense, full
attention, RoPE over the whole head, no RoPE scaling), and every tensor type the
``gguf`` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants,
the IQ types). Anything else is refused with a message naming what is not
supported, before any tensor is converted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.model.config import Architecture, ModelConfig, dtype_name
from hicache.model.errors import GGUFError, ModelConfigError

GGUF_MAGIC = b"GGUF"


_ARCHITECTURES = {
    "llama": Architecture.LLAMA,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
}

# llama.cpp's tensor names -> Hugging Face's; per layer: blk.N.<part>.{weight,bias}.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp writes for features we do not implement, with what they mean.
_REFUSED_TENSORS = {
    "rope_freqs.weight": "per-frequency RoPE factors (Llama-3.1 style RoPE scaling)",
}


def is_gguf_file(path: str | Path) -> bool:
    """A regular file starting with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _REFUSED_TENSORS:
        raise GGUFError(f"tensor {gguf_name}: {_REFUSED_TENSORS[gguf_name]} is not supported")
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise GGUFError(f"tensor {gguf_name} is not part of a supported model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"


def rotary_pairs_to_halves(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Llama q or k projection (weight or bias).

    llama.cpp's Llama RoPE rotates dimensions (2i, 2i+1) of a head together,
    Hugging Face's rotates (i, i + head_dim/2); so its converter moves row
    ``j * head_dim/2 + i`` of each head to ``2i + j``. Here row ``2i + j`` goes
    back to ``j * head_dim/2 + i``: view each head's rows as [head_dim/2, 2]
    and transpose to [2, head_dim/2]. Qwen2/Qwen3 use the half-split rotation
    in llama.cpp too, so their rows are stored as they are.
    """
    # rows: [num_heads * head_dim, *rest] -> [num_heads, head_dim/2, 2, *rest]
    head_dim = rows.shape[0] // num_heads
    paired = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return paired.transpose(1, 2).reshape(rows.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One weight of the file: its names, its shape in Hugging Face's layout, its type."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]  # [out, in] for matrices (ggml writes them [in, out])
    type_name: str


class GGUFModel:
    """An open GGUF file (memory-mapped): metadata, config and dequantized weights."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:  # bad magic / version, truncated file
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.metadata: dict[str, Any] = {
            name: field.contents() for name, field in self._reader.fields.items()
        }
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture_name = str(self.metadata.get("general.architecture", ""))

    # ------------------------------------------------------------ config
    def config(self, dtype: torch.dtype) -> ModelConfig:
        """The model's shape from the metadata, served in ``dtype``."""
        arch = _ARCHITECTURES.get(self.architecture_name)
        if arch is None:
            raise GGUFError(
                f"{self.path}: architecture {self.architecture_name!r} is not supported; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        if self._meta_int("expert_count", 0):
            raise GGUFError(f"{self.path}: mixture-of-experts models are not supported")
        scaling = self.metadata.get(self._key("rope.scaling.type"), "none")
        if scaling != "none":
            raise GGUFError(f"{self.path}: RoPE scaling {scaling!r} is not supported")
        for name, what in _REFUSED_TENSORS.items():
            if name in self._tensors:
                raise GGUFError(f"{self.path}: {what} ({name}) is not supported")
        heads = self._meta_int("attention.head_count")
        hidden = self._meta_int("embedding_length")
        head_dim = self._meta_int("attention.key_length", hidden // heads)
        if self._meta_int("attention.value_length", head_dim) != head_dim:
            raise GGUFError(f"{self.path}: value heads wider or narrower than key heads")
        rotary_dims = self._meta_int("rope.dimension_count", head_dim)
        if rotary_dims != head_dim:
            raise GGUFError(
                f"{self.path}: RoPE over {rotary_dims} of {head_dim} head dimensions "
                "(partial rotary) is not supported"
            )
        embedding = self._tensor("token_embd.weight")
        raw: dict[str, Any] = {
            "architectures": [arch.value],
            # The embedding decides: vocab_size metadata is optional and sometimes stale.
            "vocab_size": int(embedding.shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": self._meta_int("feed_forward_length"),
            "num_hidden_layers": self._meta_int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta_int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self._meta_int("context_length"),
            "rope_theta": float(self.metadata.get(self._key("rope.freq_base"), 10000.0)),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": dtype_name(dtype),
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        try:
            return ModelConfig.from_hf_dict(raw)
        except ModelConfigError as e:
            raise GGUFError(f"{self.path}: {e}") from None

    def _key(self, name: str) -> str:
        return f"{self.architecture_name}.{name}"

    def _meta(self, name: str) -> Any:
        key = self._key(name)
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata has no {key!r}")
        return self.metadata[key]

    def _meta_int(self, name: str, default: int | None = None) -> int:
        key = self._key(name)
        value = self.metadata.get(key, default) if default is not None else self._meta(name)
        if not isinstance(value, int) or isinstance(value, bool):
            # Per-layer lists (some models vary head counts by layer) land here.
            raise GGUFError(f"{self.path}: {key} = {value!r}, expected one integer")
        return value

    def _tensor(self, name: str) -> Any:
        if name not in self._tensors:
            raise GGUFError(f"{self.path}: no tensor {name}")
        return self._tensors[name]

    # ------------------------------------------------------------ weights
    def tensors(self) -> list[GGUFTensor]:
        """Every weight, in file order, named and shaped as a Hugging Face checkpoint."""
        return [
            GGUFTensor(
                gguf_name=t.name,
                hf_name=hf_tensor_name(t.name),
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                type_name=t.tensor_type.name,
            )
            for t in self._reader.tensors
        ]

    def check_types(self) -> None:
        """Dequantize the smallest tensor of each type: an unsupported type fails here,
        before hours of conversion, with the tensor and type named."""
        smallest: dict[str, Any] = {}
        for t in self._reader.tensors:
            kept = smallest.get(t.tensor_type.name)
            if kept is None or t.n_elements < kept.n_elements:
                smallest[t.tensor_type.name] = t
        for tensor in smallest.values():
            self._dequantize(tensor)

    def weights(self, config: ModelConfig) -> Iterator[tuple[GGUFTensor, torch.Tensor]]:
        """Each weight as float32 in Hugging Face's layout, one at a time (memory stays at
        one tensor)."""
        for info in self.tensors():
            values = torch.from_numpy(self._dequantize(self._tensors[info.gguf_name]))
            if config.architecture is Architecture.LLAMA:
                if ".attn_q." in info.gguf_name:
                    values = rotary_pairs_to_halves(values, config.num_heads)
                elif ".attn_k." in info.gguf_name:
                    values = rotary_pairs_to_halves(values, config.num_kv_heads)
            yield info, values

    def _dequantize(self, tensor: Any) -> np.ndarray:
        from gguf.quants import dequantize

        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(
                f"{self.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                f"the gguf package cannot dequantize ({e})"
            ) from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        return np.array(values.reshape(shape), dtype=np.float32)
