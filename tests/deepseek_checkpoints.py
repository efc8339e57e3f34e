"""Small random DeepSeek-V2/V3 checkpoints written by transformers, as reference models.

Tiny shapes (hidden 64, 3 layers, 4 routed experts) that still exercise every
path: with and without q_lora_rank, dense first layers, shared experts, each
routing rule (greedy, group-limited greedy, V3's bias-corrected sigmoid with
normalized weights), YaRN with and without an attention factor, interleaved and
rotate-half rope.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from tests.hf_checkpoints import VOCAB, Checkpoint

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _yarn(mscale: float, mscale_all_dim: float) -> dict[str, Any]:
    # A short original context (32) that the tests' 41-token prompts pass; factor 8 =
    # 256 / 32 as real configs keep it.
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def deepseek_variants() -> dict[str, PretrainedConfig]:
    return {
        # DeepSeek-V2-Lite's layout: no q_lora_rank, greedy softmax routing, one dense
        # layer first, two shared experts, YaRN whose mscale == mscale_all_dim.
        "v2-lite": DeepseekV2Config(
            **_COMMON,
            q_lora_rank=None,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            rope_parameters=_yarn(0.707, 0.707),
        ),
        # DeepSeek-V2's layout: q_lora_rank, group-limited routing, no dense layer; YaRN
        # with mscale != mscale_all_dim (cos/sin scaled too).
        "v2-group": DeepseekV2Config(
            **_COMMON,
            q_lora_rank=24,
            n_shared_experts=1,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            rope_parameters=_yarn(1.0, 0.8),
        ),
        # DeepSeek-V3: sigmoid scores with correction bias, groups by top-2 sum,
        # normalized weights, interleaved rope, YaRN.
        "v3": DeepseekV3Config(
            **_COMMON,
            q_lora_rank=24,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_parameters=_yarn(1.0, 1.0),
        ),
        # V3 with rotate-half rope and no scaling, two dense layers first.
        "v3-rotate-half": DeepseekV3Config(
            **_COMMON,
            q_lora_rank=None,
            n_shared_experts=1,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_interleave=False,
        ),
    }


_MODEL_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    DeepseekV2Config: DeepseekV2ForCausalLM,
    DeepseekV3Config: DeepseekV3ForCausalLM,
}


def build_deepseek(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A float32 transformers DeepSeek model (sdpa attention) with seeded random weights."""
    config._attn_implementation = "sdpa"
    model = _MODEL_CLASSES[type(config)](config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=generator)
            else:
                param.normal_(0.0, 0.1, generator=generator)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Large enough to change which experts win against the raw scores.
                buffer.normal_(0.0, 0.3, generator=generator)
    return model


def write_deepseek(config: PretrainedConfig, path: Path, seed: int = 0) -> Checkpoint:
    model = build_deepseek(config, seed)
    model.save_pretrained(path, safe_serialization=True)
    return Checkpoint(path, model)
