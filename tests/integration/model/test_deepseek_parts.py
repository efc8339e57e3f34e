"""The parts of the DeepSeek models on their own: config keys, routing rules, MoE batching,
the two MLA attention forms, and the deepseek-v2-lite preset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from hicache.memory.geometry import DEEPSEEK_V2_LITE
from hicache.model.config import ModelConfig
from hicache.model.deepseek_config import MLAShape, MoEShape, RoutingMethod
from hicache.model.errors import ModelConfigError
from hicache.model.loader import load_model
from hicache.model.mla_attention import attend_absorbed, attend_expanded
from hicache.model.mla_step import absorbed_is_cheaper
from hicache.model.model import CausalLM
from hicache.model.moe import MoE
from hicache.model.moe_routing import route
from hicache.model.presets import get_preset
from hicache.model.safetensors_writer import SafetensorsWriter
from hicache.model.weights import init_dummy_weights


def _v3_raw(**changes: Any) -> dict[str, Any]:
    raw = DeepseekV3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    ).to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"attention_bias": True}, "attention_bias"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear"),
        ({"n_group": 3}, "n_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_config_is_refused_by_name(changes: dict[str, Any], named: str) -> None:
    ModelConfig.from_hf_dict(_v3_raw())  # the base is fine
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.from_hf_dict(_v3_raw(**changes))


def test_v2_refuses_v3_routing_and_normalized_weights() -> None:
    raw = _v3_raw(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc")
    with pytest.raises(ModelConfigError, match="topk_method"):
        ModelConfig.from_hf_dict(raw)
    raw.update(topk_method="greedy", scoring_func="softmax", norm_topk_prob=True)
    with pytest.raises(ModelConfigError, match="norm_topk_prob"):
        ModelConfig.from_hf_dict(raw)


def test_v3_skips_the_multi_token_prediction_layer() -> None:
    config = ModelConfig.from_hf_dict(_v3_raw(num_nextn_predict_layers=1))
    assert config.extra_checkpoint_layers == 1 and config.moe is not None
    assert config.moe.routing is RoutingMethod.NOAUX_TC  # V3's default when unnamed


# ---------------------------------------------------------------------- routing
def _moe_shape(routing: RoutingMethod, norm: bool = False) -> MoEShape:
    return MoEShape(
        num_routed_experts=8, num_shared_experts=1, num_experts_per_tok=3,
        moe_intermediate_size=16, first_k_dense_replace=0, routed_scaling_factor=1.7,
        routing=routing, n_group=4, topk_group=2, norm_topk_prob=norm,
    )


def _by_expert(weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, k] pairs -> [T, experts] dense weights (order-free comparison)."""
    return torch.zeros(weights.shape[0], 8).scatter_(1, experts, weights)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_equals_transformers(method: str) -> None:
    hf_config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method=method, routed_scaling_factor=1.7,
    )
    router = DeepseekV2TopkRouter(hf_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=generator)
    x = torch.randn(50, 32, generator=generator)
    logits, hf_weights, hf_experts = router(x)
    weights, experts = route(logits, _moe_shape(RoutingMethod(method)))
    torch.testing.assert_close(_by_expert(weights, experts), _by_expert(hf_weights, hf_experts))


@pytest.mark.parametrize("norm", [True, False])
def test_v3_routing_equals_transformers(norm: bool) -> None:
    hf_config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=norm, routed_scaling_factor=1.7,
    )
    router = DeepseekV3TopkRouter(hf_config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=generator)
        router.e_score_correction_bias.normal_(0, 0.5, generator=generator)
    x = torch.randn(50, 32, generator=generator)
    logits, hf_weights, hf_experts = router(x)
    moe = _moe_shape(RoutingMethod.NOAUX_TC, norm)
    weights, experts = route(logits, moe, router.e_score_correction_bias)
    torch.testing.assert_close(_by_expert(weights, experts), _by_expert(hf_weights, hf_experts))
    # The bias changes choices (so the test would see it ignored) but never the weights' source.
    unbiased = route(logits, moe, torch.zeros(8))[1].sort(dim=1).values
    assert not torch.equal(unbiased, experts.sort(dim=1).values)


def test_moe_batched_by_expert_equals_token_by_token() -> None:
    moe_shape = _moe_shape(RoutingMethod.GREEDY)
    moe = MoE(32, moe_shape, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.3, generator=generator)
    x = torch.randn(40, 32, generator=generator)
    got = moe(x)
    weights, experts = route(torch.nn.functional.linear(x, moe.gate_weight), moe_shape)
    n = moe.columns.size
    expected = torch.zeros_like(x)
    assert moe.shared is not None
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            gate_up = moe.gate_up_weight[e] @ x[t]
            expected[t] += w * (moe.down_weight[e] @ (torch.nn.functional.silu(gate_up[:n])
                                                     * gate_up[n:]))
        shared = moe.shared.gate_up_weight @ x[t]
        half = shared.shape[0] // 2
        expected[t] += moe.shared.down_weight @ (torch.nn.functional.silu(shared[:half])
                                                 * shared[half:])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- MLA forms
def test_absorbed_form_equals_expanded_form() -> None:
    """Several sequences, new tokens after a context, padded context rows masked out."""
    mla = MLAShape(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=12, softmax_scale=0.2)
    generator = torch.Generator().manual_seed(3)
    heads, b, e, length = 4, 3, 5, 20
    q = torch.randn(b, e, heads, mla.qk_head_dim, generator=generator)
    rows = torch.randn(b, length, mla.latent_dim, generator=generator)
    kv_b = torch.randn(heads * (16 + 12), 32, generator=generator) * 0.2
    lens = torch.tensor([20, 9, 14])
    pos = torch.arange(length)
    query_pos = lens[:, None] - e + torch.arange(e)[None, :]  # [B, E]
    mask = pos[None, None, :] <= query_pos[:, :, None]
    expanded = attend_expanded(q, rows, mask, kv_b, mla)
    absorbed = attend_absorbed(q, rows, mask, kv_b, mla)
    assert expanded.shape == (b, e, heads, 12)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    # The padded rows matter to neither: changing them changes nothing.
    rows[1, 9:] = 100.0
    torch.testing.assert_close(attend_absorbed(q, rows, mask, kv_b, mla), absorbed)


# ---------------------------------------------------------------------- preset
def test_deepseek_v2_lite_preset_has_the_real_shape() -> None:
    config = get_preset("deepseek-v2-lite")
    assert config.mla is not None and config.moe is not None
    assert (config.num_layers, config.hidden_size, config.num_heads) == (27, 2048, 16)
    assert config.mla.latent_dim == 576 and config.mla.q_lora_rank is None
    assert (config.moe.num_routed_experts, config.moe.num_experts_per_tok) == (64, 6)
    # YaRN's softmax factor: (0.1 * 0.707 * ln 40 + 1)^2 over sqrt(192).
    assert config.mla.softmax_scale == pytest.approx(192**-0.5 * 1.2608**2, rel=1e-3)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    # Every rank caches the whole latent: the same geometry at any TP size.
    assert config.kv_geometry() == DEEPSEEK_V2_LITE
    assert config.kv_geometry(tp_rank=1, tp_size=4) == DEEPSEEK_V2_LITE


# ---------------------------------------------------------------------- weights
def test_dummy_weights_round_trip_through_a_safetensors_dir(tmp_path: Path) -> None:
    """Our writer and loader agree on every DeepSeek tensor name (experts, router and
    its correction bias, MLA projections): a dummy model written as a model dir loads
    back into the same weights."""
    raw = _v3_raw(dtype="float32", num_nextn_predict_layers=0, first_k_dense_replace=1)
    config = ModelConfig.from_hf_dict(raw)
    model = CausalLM(config)
    init_dummy_weights(model, seed=5)
    weights = model.hf_weights()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in weights
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # first_k_dense_replace = 1
    layout = [(name, tuple(t.shape)) for name, t in weights.items()]
    with SafetensorsWriter(tmp_path / "model.safetensors", layout, torch.float32) as writer:
        for name, tensor in weights.items():
            writer.write(name, tensor)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    loaded = load_model(tmp_path, "auto", None, "float32", "cpu").model
    assert loaded.config == config
    for name, tensor in loaded.hf_weights().items():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.parametrize(
    "key", ["n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
            "norm_topk_prob", "n_group", "kv_lora_rank"],
)
def test_keys_with_version_dependent_defaults_are_required(key: str) -> None:
    raw = _v3_raw()
    del raw[key]
    with pytest.raises(ModelConfigError, match=key):
        ModelConfig.from_hf_dict(raw)


def test_auto_form_follows_the_arithmetic_cost() -> None:
    mla = get_preset("deepseek-v2-lite").mla
    assert mla is not None
    assert all(absorbed_is_cheaper(1, length, mla) for length in (2, 100, 10**5))
    assert not any(absorbed_is_cheaper(n, n, mla) for n in (2, 100, 10**4))  # cold prompts
    # The cases measured in docs/benchmarks.md, each the faster form there.
    assert absorbed_is_cheaper(64, 2048, mla)
    assert not absorbed_is_cheaper(256, 256, mla)
