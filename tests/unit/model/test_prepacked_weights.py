"""Weights prepacked for oneDNN compute what the plain parameters do."""

from __future__ import annotations

import torch

from hicache.model.linear import linear, prepack
from tests.model_scenarios import dummy_model, mixed_batch_vs_alone, small_qwen3_style


def test_prepacked_model_equals_the_plain_one() -> None:
    # Qwen3-style: qkv and o biases, qk-norm, tied LM head; a mixed step.
    config = small_qwen3_style()
    plain = dummy_model(config)
    packed = dummy_model(config)
    assert packed.prepack_weights()
    assert packed.packed_lm_head is not None and packed.packed_lm_head.is_mkldnn
    expected, _ = mixed_batch_vs_alone(plain, (6, 4), [5, 2, 12])
    got, alone = mixed_batch_vs_alone(packed, (6, 4), [5, 2, 12])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alone, expected, atol=1e-4, rtol=1e-4)


def test_prepack_declines_what_onednn_cannot_pack() -> None:
    weight = torch.randn(8, 4)
    assert prepack(torch.randn(3)) is None  # not a matrix
    assert prepack(weight.to("meta")) is None  # not on the CPU
    packed = prepack(weight)
    assert packed is not None  # float32 packs on every CPU oneDNN supports
    x = torch.randn(5, 4)
    torch.testing.assert_close(linear(x, packed), x @ weight.T)
    assert linear(x, weight).equal(torch.nn.functional.linear(x, weight))
