"""The DeepSeek-V2/V3 part of a ModelConfig: MLA shape, MoE shape, YaRN RoPE, from config.json.

Keys are read as transformers reads them (``DeepseekV2Config``, ``DeepseekV3Config``),
from both config.json dialects (``rope_scaling`` + ``rope_theta``, or transformers 5's
``rope_parameters``). What would change the math and is not implemented is refused
with the field named: attention biases, fp8 checkpoints, other routing rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from hicache.model.errors import ModelConfigError

if TYPE_CHECKING:
    from hicache.model.config import Architecture, ModelConfig


class RoutingMethod(str, Enum):
    """How a token picks its routed experts (config.json's ``topk_method``)."""

    GREEDY = "greedy"  # V2: softmax scores, top-k over all experts
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # V2: top-k within the best groups
    NOAUX_TC = "noaux_tc"  # V3: sigmoid scores + correction bias choose, groups by top-2 sum


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (``rope_type: "yarn"``) as DeepSeek's configs set it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None  # config.json's ``attention_factor``
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_max_position_embeddings < 1:
            raise ModelConfigError(f"rope_scaling (yarn): need factor > 0, got {self}")

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (so q.k of the rope part by its square)."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What DeepSeek multiplies the whole softmax scale by: mscale(factor, mscale_all_dim)^2."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention: per token one latent of ``kv_lora_rank`` (normed)
    plus a shared rotary key of ``qk_rope_head_dim`` is cached; ``kv_b_proj`` expands
    the latent into every head's K_nope and V."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # DeepSeek's rope rotates interleaved pairs (x0, x1), (x2, x3)...; False: rotate-half.
    rope_interleave: bool = True
    softmax_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ModelConfigError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEShape:
    num_routed_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    routing: RoutingMethod
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_routed_experts:
            raise ModelConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, n_routed_experts = {self.num_routed_experts}]"
            )
        if self.routing is not RoutingMethod.GREEDY:
            if self.n_group < 1 or self.num_routed_experts % self.n_group:
                raise ModelConfigError(
                    f"n_group ({self.n_group}) must divide n_routed_experts "
                    f"({self.num_routed_experts})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ModelConfigError(f"topk_group ({self.topk_group}) must be in [1, n_group]")
            per_group = self.num_routed_experts // self.n_group
            if self.topk_group * per_group < self.num_experts_per_tok:
                raise ModelConfigError(
                    "the topk_group best groups hold fewer experts than num_experts_per_tok"
                )
            if self.routing is RoutingMethod.NOAUX_TC and per_group < 2:
                raise ModelConfigError("noaux_tc ranks groups by their top-2 sum: 2+ experts each")

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def parse_deepseek(raw: Mapping[str, Any], arch: Architecture) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V2/V3 config.json (besides the common ones)."""
    from hicache.model.config import Architecture

    v3 = arch is Architecture.DEEPSEEK_V3
    if raw.get("attention_bias"):
        raise ModelConfigError("attention_bias=true is not supported for DeepSeek models")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelConfigError(f"moe_layer_freq {raw['moe_layer_freq']} is not supported (only 1)")
    num_heads = _int(raw, "num_attention_heads")
    theta, scaling = _deepseek_rope(raw)
    q_lora = raw.get("q_lora_rank")
    mla_dims = {key: _int(raw, key) for key in (
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    softmax_scale = (mla_dims["qk_nope_head_dim"] + mla_dims["qk_rope_head_dim"]) ** -0.5
    if scaling is not None:
        softmax_scale *= scaling.softmax_factor
    mla = MLAShape(
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        **mla_dims,
        # transformers' V2 always rotates interleaved pairs; V3 says which.
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
        softmax_scale=softmax_scale,
    )
    return {
        "num_kv_heads": num_heads,  # MLA has no KV heads: every head reads the one latent
        "head_dim": mla.qk_rope_head_dim,  # what RoPE rotates
        "rope_theta": theta,
        "rope_scaling": scaling,
        "mla": mla,
        "moe": _moe(raw, v3),
        "extra_checkpoint_layers": int(raw.get("num_nextn_predict_layers") or 0) if v3 else 0,
    }


def _moe(raw: Mapping[str, Any], v3: bool) -> MoEShape:
    scoring = raw.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        expected = "sigmoid for V3" if v3 else "softmax for V2"
        raise ModelConfigError(f"scoring_func {scoring!r} is not supported ({expected})")
    method_name = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method_name not in allowed:
        raise ModelConfigError(
            f"topk_method {method_name!r} is not supported for "
            f"{'DeepseekV3' if v3 else 'DeepseekV2'}; supported: {', '.join(allowed)}"
        )
    # Keys whose absence transformers fills with per-version defaults (V3's differ from
    # V2's) are required instead: real and transformers-written configs all state them.
    norm_topk_prob = _bool(raw, "norm_topk_prob")
    if norm_topk_prob and not v3:
        # transformers' V2 ignores it, DeepSeek's own V2 code honours it: no released V2
        # sets it, and we will not pick one of two disagreeing meanings silently.
        raise ModelConfigError("norm_topk_prob=true is not supported for DeepseekV2")
    routing = RoutingMethod(method_name)
    grouped = routing is not RoutingMethod.GREEDY
    return MoEShape(
        num_routed_experts=_int(raw, "n_routed_experts"),
        num_shared_experts=_int(raw, "n_shared_experts"),
        num_experts_per_tok=_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        first_k_dense_replace=_int(raw, "first_k_dense_replace"),
        routed_scaling_factor=_float(raw, "routed_scaling_factor"),
        routing=routing,
        # Greedy routing ignores groups; the others need both.
        n_group=_int(raw, "n_group") if grouped else 1,
        topk_group=_int(raw, "topk_group") if grouped else 1,
        norm_topk_prob=norm_topk_prob,
    )


def _deepseek_rope(raw: Mapping[str, Any]) -> tuple[float, YarnRopeScaling | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported for DeepSeek; supported: default, yarn"
        )
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ModelConfigError("yarn rope scaling is missing 'original_max_position_embeddings'")
    if factor is None:  # as transformers: the ratio of the two context lengths
        factor = _int(raw, "max_position_embeddings") / original
    return theta, YarnRopeScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        attention_factor_override=_optional_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
    )


def deepseek_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """The DeepSeek keys of ``config.to_hf_dict()`` (inverse of ``parse_deepseek``)."""
    from hicache.model.config import Architecture

    mla, moe = config.mla, config.moe
    assert mla is not None and moe is not None
    raw: dict[str, Any] = {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "n_routed_experts": moe.num_routed_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "first_k_dense_replace": moe.first_k_dense_replace,
        "moe_layer_freq": 1,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "topk_method": moe.routing.value,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "scoring_func": "sigmoid" if moe.routing is RoutingMethod.NOAUX_TC else "softmax",
        "attention_bias": False,
    }
    if config.architecture is Architecture.DEEPSEEK_V3:
        raw["rope_interleave"] = mla.rope_interleave
        raw["num_nextn_predict_layers"] = config.extra_checkpoint_layers
    s = config.rope_scaling
    if isinstance(s, YarnRopeScaling):
        raw["rope_scaling"] = {
            "type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "mscale": s.mscale,
            "mscale_all_dim": s.mscale_all_dim,
        }
    return raw


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config.json needs an integer {key!r}, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str) -> float:
    value = raw.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ModelConfigError(f"config.json needs a number {key!r}, got {value!r}")
    return float(value)


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key)
    if not isinstance(value, bool):
        raise ModelConfigError(f"config.json needs a boolean {key!r}, got {value!r}")
    return value


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
