"""ModelConfig: the shape of a decoder-only transformer, parsed from a Hugging Face config.json.

Supported: ``LlamaForCausalLM`` (with Llama-3.1 "llama3" RoPE scaling),
``Qwen2ForCausalLM`` (q/k/v bias), ``Qwen3ForCausalLM`` (RMSNorm on q and k per
head before RoPE), and ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (MLA
attention and MoE FFN; their keys in ``hicache.model.deepseek_config``). Both
config.json dialects are read: the classic one (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and transformers 5's (``rope_parameters``, ``dtype``). Anything
that would change the math and that we do not implement (another activation,
sliding windows, quantization, other RoPE types) is refused with a message naming
the field: silently ignoring it would serve wrong logits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hicache.distributed.sharding import kv_head_span
from hicache.memory.geometry import KVGeometry
from hicache.model.errors import ModelConfigError

if TYPE_CHECKING:
    from hicache.model.deepseek_config import MLAShape, MoEShape, YarnRopeScaling


class Architecture(str, Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class _Traits:
    """What an architecture fixes that its config.json does not say."""

    model_type: str
    # RMSNorm over head_dim on q and k, before RoPE (Qwen3).
    qk_norm: bool
    # Qwen2 always has q/k/v biases and a bias-free o_proj; the others follow
    # config.json's ``attention_bias`` for all four projections.
    qwen2_biases: bool


_TRAITS: dict[Architecture, _Traits] = {
    Architecture.LLAMA: _Traits("llama", qk_norm=False, qwen2_biases=False),
    Architecture.QWEN2: _Traits("qwen2", qk_norm=False, qwen2_biases=True),
    Architecture.QWEN3: _Traits("qwen3", qk_norm=True, qwen2_biases=False),
    Architecture.DEEPSEEK_V2: _Traits("deepseek_v2", qk_norm=False, qwen2_biases=False),
    Architecture.DEEPSEEK_V3: _Traits("deepseek_v3", qk_norm=False, qwen2_biases=False),
}
_DEEPSEEK = (Architecture.DEEPSEEK_V2, Architecture.DEEPSEEK_V3)
_BY_MODEL_TYPE = {traits.model_type: arch for arch, traits in _TRAITS.items()}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``, ``"bf16"``, ``torch.float16``... -> a supported torch dtype."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ModelConfigError(f"dtype {value} is not supported; use float32, float16 or bfloat16")
    dtype = _DTYPES.get(value.lower().removeprefix("torch."))
    if dtype is None:
        raise ModelConfigError(f"unknown dtype {value!r}; use one of: {', '.join(sorted(_DTYPES))}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0:
            raise ModelConfigError(
                "rope_scaling (llama3): need factor > 0, high_freq_factor > low_freq_factor > 0, "
                f"got {self}"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # DeepSeek: multi-head latent attention and the MoE FFN (None for the others).
    # ``head_dim`` is then the rotary part of a head (qk_rope_head_dim), as transformers has it.
    mla: MLAShape | None = None
    moe: MoEShape | None = None
    # Layers a checkpoint carries past ``num_layers`` that serving does not run
    # (DeepSeek-V3's multi-token-prediction layer): their tensors are skipped on load.
    extra_checkpoint_layers: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ModelConfigError("rope_theta and rms_norm_eps must be positive")
        parse_dtype(self.dtype)

    # ------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        """Width of all query heads: num_heads * head_dim (not always hidden_size: Qwen3)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_geometry(
        self, dtype: torch.dtype | None = None, *, tp_rank: int = 0, tp_size: int = 1
    ) -> KVGeometry:
        """The KV cache geometry of rank ``tp_rank`` of ``tp_size`` (its KV heads only;
        see ``hicache.distributed.sharding``), in ``dtype`` or the model's dtype.

        MLA: one latent per token per layer, the same whole latent on every rank."""
        if self.mla is not None:
            return KVGeometry.mla(
                self.num_layers, self.mla.latent_dim, self.dtype if dtype is None else dtype
            )
        num_kv_heads = (
            self.num_kv_heads
            if tp_size == 1
            else kv_head_span(self.num_heads, self.num_kv_heads, tp_rank, tp_size).size
        )
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype if dtype is None else dtype,
        )

    def with_dtype(self, dtype: str | torch.dtype) -> ModelConfig:
        return replace(self, dtype=parse_dtype(dtype))

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        """Read ``model_path/config.json``."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"{model_path}: no config.json (expected a Hugging Face model dir)"
            )
        try:
            with path.open() as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: cannot be read as JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_hf_dict(raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises ModelConfigError naming any unsupported field."""
        arch = _architecture(raw)
        traits = _TRAITS[arch]
        _refuse_unsupported(raw)
        num_heads = _require(raw, "num_attention_heads")
        hidden_size = _require(raw, "hidden_size")
        if arch in _DEEPSEEK:
            from hicache.model.deepseek_config import parse_deepseek

            return cls(**_common_fields(raw, arch), **parse_deepseek(raw, arch))
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        dtype_value = raw.get("dtype") or raw.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=_require(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(raw, "intermediate_size"),
            num_layers=_require(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=_require(raw, "max_position_embeddings"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if traits.qwen2_biases else attention_bias,
            o_bias=False if traits.qwen2_biases else attention_bias,
            qk_norm=traits.qk_norm,
            # Real checkpoints always state their dtype; bf16 is what serving uses anyway.
            dtype=parse_dtype(dtype_value) if dtype_value else torch.bfloat16,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers would write for this model (inverse of from_hf_dict)."""
        traits = _TRAITS[self.architecture]
        raw: dict[str, Any] = {
            "architectures": [self.architecture.value],
            "model_type": traits.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": dtype_name(self.dtype),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if not traits.qwen2_biases:
            raw["attention_bias"] = self.qkv_bias
        if self.architecture in _DEEPSEEK:
            from hicache.model.deepseek_config import deepseek_hf_fields

            raw.update(deepseek_hf_fields(self))
        elif isinstance(self.rope_scaling, Llama3RopeScaling):
            raw["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": (
                    self.rope_scaling.original_max_position_embeddings
                ),
            }
        return raw


# ------------------------------------------------------------------ helpers
def _common_fields(raw: Mapping[str, Any], arch: Architecture) -> dict[str, Any]:
    """The fields every architecture reads alike (DeepSeek adds its own)."""
    dtype_value = raw.get("dtype") or raw.get("torch_dtype")
    return {
        "architecture": arch,
        "vocab_size": _require(raw, "vocab_size"),
        "hidden_size": _require(raw, "hidden_size"),
        "intermediate_size": _require(raw, "intermediate_size"),
        "num_layers": _require(raw, "num_hidden_layers"),
        "num_heads": _require(raw, "num_attention_heads"),
        "max_position_embeddings": _require(raw, "max_position_embeddings"),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "dtype": parse_dtype(dtype_value) if dtype_value else torch.bfloat16,
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": _token_ids(raw.get("eos_token_id")),
    }


def _architecture(raw: Mapping[str, Any]) -> Architecture:
    supported = ", ".join(a.value for a in Architecture)
    names = raw.get("architectures")
    if not names:
        model_type = raw.get("model_type")
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ModelConfigError(
            f"config.json names no architecture (model_type {model_type!r}); supported: {supported}"
        )
    if len(names) != 1:
        raise ModelConfigError(f"architectures must name exactly one class, got {names}")
    try:
        return Architecture(names[0])
    except ValueError:
        raise ModelConfigError(
            f"unsupported architecture {names[0]!r}; supported: {supported}"
        ) from None


def _refuse_unsupported(raw: Mapping[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
    if raw.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ModelConfigError("use_sliding_window=true is not supported (full attention only)")
    layer_types = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ModelConfigError(f"layer_types {sorted(set(layer_types))}: only full_attention")
    if raw.get("quantization_config"):
        raise ModelConfigError("quantized checkpoints (quantization_config) are not supported")


def _rope(raw: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 folds rope_theta into rope_parameters; older configs keep it top-level
    # and put scaling, when any, in rope_scaling (with "type" in the oldest ones).
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported; supported: default, llama3"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelConfigError(f"llama3 rope scaling is missing {e.args[0]!r}") from None
    return theta, scaling


def _require(raw: Mapping[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ModelConfigError(f"config.json has no {key!r}")
    value = raw[key]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ModelConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")
