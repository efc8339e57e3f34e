"""The last layer computes its o projection and MLP for the sampled rows only.

Past the last layer's K/V, only the rows whose logits are returned are used; the
other rows' o projection and MLP are skipped. What must hold: the logits equal those
of the whole computation (every row through every layer), the pool receives the same
K/V, and the skipped rows are really not computed.
"""

from __future__ import annotations

import pytest
import torch

from hicache.model.batch import ForwardBatch
from hicache.model.model import CausalLM, LayerBlocks
from hicache.model.presets import get_preset
from tests.model_scenarios import (
    SlotAllocator,
    dummy_model,
    new_pool,
    random_tokens,
    small_qwen3_style,
)

CONFIGS = {"tiny-llama": get_preset("tiny"), "qwen3-style": small_qwen3_style(num_layers=3)}
TOL = {"atol": 5e-6, "rtol": 1e-6}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest) -> CausalLM:
    return dummy_model(CONFIGS[request.param])


def _batch(model: CausalLM, seed: int, **options: object) -> tuple[ForwardBatch, object]:
    """Two prompts of 11 and 6 tokens on fresh pages of a fresh pool."""
    pool = new_pool(model)
    alloc = SlotAllocator(pool, seed=seed)
    prompts = [random_tokens(n, model.config.vocab_size, seed=n) for n in (11, 6)]
    batch = ForwardBatch.from_sequences(
        prompts, [alloc.slots(len(p)) for p in prompts], device=model.device, **options)
    return batch, pool


def test_sampled_rows_equal_the_whole_computation(model: CausalLM) -> None:
    whole_batch, whole_pool = _batch(model, seed=1, return_all_logits=True)
    whole = model(whole_batch, whole_pool)
    batch, pool = _batch(model, seed=1)
    got = model(batch, pool)
    assert got.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(got, whole[[10, 16]], **TOL)
    # The K/V of every token reached the pool, as the whole computation's.
    torch.testing.assert_close(pool.flat, whole_pool.flat, **TOL)


def test_logits_from_rows_equal_the_whole_computation(model: CausalLM) -> None:
    whole_batch, whole_pool = _batch(model, seed=2, return_all_logits=True)
    whole = model(whole_batch, whole_pool)
    batch, pool = _batch(model, seed=2, logits_from=[8, 0])
    got = model(batch, pool)
    torch.testing.assert_close(got, whole[[8, 9, 10, *range(11, 17)]], **TOL)


def test_only_the_last_layer_skips_rows(model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    blocks = model.blocks

    def post(attn: torch.Tensor, residual: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append(attn.shape[0])
        assert residual.shape[0] == attn.shape[0]
        return blocks.post(attn, residual, *rest)

    monkeypatch.setattr(model, "blocks", LayerBlocks(blocks.pre, post, blocks.attention_output,
                                                     blocks.feed_forward))
    layers = model.config.num_layers
    model(*_batch(model, seed=3))
    assert seen == [17] * (layers - 1) + [2]
    seen.clear()
    model(*_batch(model, seed=3, return_all_logits=True))
    assert seen == [17] * layers
