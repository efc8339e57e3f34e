"""Named model shapes for ``--load-format dummy`` (tests, benchmarks, demos without weights).

The real presets copy the published config.json shapes, so a dummy model costs
exactly what the real one does in FLOPs, memory and KV bytes; their KV geometry
equals ``hicache.memory.geometry``'s preset of the same name. Token ids for
bos/eos are left out: a dummy model is served with the byte-level tokenizer,
which brings its own.
"""

from __future__ import annotations

import torch

from hicache.model.config import Architecture, Llama3RopeScaling, ModelConfig
from hicache.model.errors import ModelConfigError

# deepseek-ai/DeepSeek-V2-Lite's config.json (the keys that shape the model): MLA without
# q_lora_rank, 64 routed experts (6 per token) + 2 shared, the first layer dense.
_DEEPSEEK_V2_LITE: dict[str, object] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, ModelConfig] = {
    # The CPU default: small enough for unit tests, with GQA (4 query heads over 2 KV heads)
    # and a vocab that holds the byte tokenizer's 256 bytes plus its specials.
    # KV geometry = memory.geometry.TINY.
    "tiny": ModelConfig(
        architecture=Architecture.LLAMA,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        dtype=torch.float32,
    ),
    # Qwen/Qwen3-0.6B. KV geometry = memory.geometry.QWEN3_0_6B.
    "qwen3-0.6b": ModelConfig(
        architecture=Architecture.QWEN3,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
        dtype=torch.bfloat16,
    ),
    # meta-llama/Llama-3.1-8B: Llama-3-8B's shape plus llama3 RoPE scaling, so contexts past
    # 8K tokens (the prefill benchmark's 16K) are in range. KV geometry = memory.geometry.LLAMA3_8B.
    "llama3-8b": ModelConfig(
        architecture=Architecture.LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        dtype=torch.bfloat16,
    ),
    # deepseek-ai/DeepSeek-V2-Lite (15.7B parameters, 2.4B active per token).
    # KV geometry = memory.geometry.DEEPSEEK_V2_LITE: one 576-element latent per layer.
    "deepseek-v2-lite": ModelConfig.from_hf_dict(_DEEPSEEK_V2_LITE),
}

DEFAULT_PRESET = "tiny"


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
