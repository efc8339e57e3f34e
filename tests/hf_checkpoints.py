"""Small random checkpoints written by Hugging Face transformers itself, as reference models.

Each variant is a transformers config class instance; ``write_checkpoint``
builds the transformers model, gives it random weights of a useful scale
(transformers' own init makes logits nearly constant), writes it with
``save_pretrained`` and returns the model next to the directory, so a test can
compare our loader's model against the one that wrote the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# transformers is a test dependency only; it is imported here, not by the package.
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Above the byte-level tokenizer's 262 ids: dirs without tokenizer.json fall back to it.
VOCAB = 320
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def _llama3_rope(theta: float) -> dict[str, Any]:
    # A short original context (32) puts head_dim 16's frequencies in all three bands
    # (kept, interpolated, slowed down) and lets a 40-token prompt pass it.
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }


def variants() -> dict[str, PretrainedConfig]:
    """The checkpoint shapes the reference tests cover, by id."""
    return {
        # Plain Llama: GQA (2 query heads per KV head), untied output projection.
        "llama-gqa": LlamaConfig(
            **_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
        ),
        # Llama-3.1 RoPE scaling, tied embeddings, biases on all four attention projections,
        # 4 query heads per KV head.
        "llama3-rope-tied-bias": LlamaConfig(
            **_COMMON,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters=_llama3_rope(50000.0),
        ),
        # Qwen2: q/k/v biases (o_proj without), plain multi-head attention.
        "qwen2-qkv-bias": Qwen2Config(
            **_COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
        ),
        # Qwen3: RMSNorm on q and k per head, head_dim (24) != hidden / heads (16), tied,
        # a single KV head (MQA).
        "qwen3-qknorm-tied": Qwen3Config(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            tie_word_embeddings=True,
        ),
    }


_MODEL_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    LlamaConfig: LlamaForCausalLM,
    Qwen2Config: Qwen2ForCausalLM,
    Qwen3Config: Qwen3ForCausalLM,
}


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    hf: PreTrainedModel  # the float32 transformers model whose weights are at ``path``


def build_hf_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A float32 transformers model (sdpa attention) with seeded random weights."""
    config._attn_implementation = "sdpa"
    model = _MODEL_CLASSES[type(config)](config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm gains away from 1, so a norm applied at the wrong place shows.
                param.uniform_(0.5, 1.5, generator=generator)
            else:
                # Matrices and biases: std 0.1 over width 64 keeps activations near unit
                # scale, so logits span a few units and differ clearly between tokens.
                param.normal_(0.0, 0.1, generator=generator)
    return model


def write_checkpoint(
    config: PretrainedConfig, path: Path, seed: int = 0, **save: Any
) -> Checkpoint:
    """``save_pretrained`` a random model of ``config`` into ``path`` (safetensors)."""
    model = build_hf_model(config, seed)
    model.save_pretrained(path, safe_serialization=True, **save)
    return Checkpoint(path, model)


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """All-position float32 logits [len(token_ids), vocab] of one cold forward."""
    out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


@torch.inference_mode()
def hf_greedy_decode(
    model: PreTrainedModel, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode through transformers' own KV cache.

    Returns the ``steps`` generated tokens and the logits each decode step
    produced (step i's logits are for the token after generated token i).
    """
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    token = int(out.logits[0, -1].argmax())
    generated, logits = [token], []
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        token = int(step_logits.argmax())
        generated.append(token)
    return generated, logits
