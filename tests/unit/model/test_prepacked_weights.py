"""Weights prepacked for oneDNN compute what the plain parameters do."""

from __future__ import annotations

import time

import pytest
import torch

from hicache.model.linear import linear, one_row_clock, prepack
from hicache.model.model import CausalLM
from tests.model_scenarios import (
    SlotAllocator,
    dummy_model,
    mixed_batch_vs_alone,
    new_pool,
    random_tokens,
    run_in_steps,
    small_qwen3_style,
)


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


def _onednn_products(model: CausalLM, rows: int) -> int:
    """How many oneDNN linear calls a forward of ``rows`` new tokens makes."""
    pool = new_pool(model)
    tokens = random_tokens(rows, model.config.vocab_size, seed=rows)
    slots = SlotAllocator(pool).slots(rows)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_in_steps(model, pool, tokens, slots, [rows])
    return sum(1 for event in prof.events() if "_linear_pointwise" in event.name)


def test_a_single_row_multiplies_by_the_plain_weights_when_told() -> None:
    # One row (one request decoding) measured faster with column-major plain weights on
    # some CPUs, with the packed ones on others.
    model = dummy_model(small_qwen3_style())
    assert model.prepack_weights(one_row="column-major")
    layers = model.config.num_layers
    assert _onednn_products(model, 1) == 0
    assert _onednn_products(model, 3) == 4 * layers + 1  # qkv, o, gate_up, down; the head
    packed = dummy_model(small_qwen3_style())
    assert packed.prepack_weights(one_row="packed")
    assert _onednn_products(packed, 1) == 4 * layers + 1
    assert packed.one_row_lm_head is None
    assert packed.layers[0].self_attn.qkv_weight.is_contiguous()  # left row-major


def test_one_row_choice_is_measured_and_either_way_equals_the_plain_model() -> None:
    config = small_qwen3_style()
    plain, measured = dummy_model(config), dummy_model(config)
    assert measured.prepack_weights()  # auto: timed on this CPU
    assert measured.packed_from_rows in (1, 2)
    assert (measured.one_row_lm_head is not None) == (measured.packed_from_rows == 2)
    tokens = random_tokens(5, config.vocab_size, seed=4)
    results = []
    for model in (plain, measured):
        pool = new_pool(model)
        results.append(run_in_steps(model, pool, tokens, SlotAllocator(pool).slots(5),
                                    [2, 1, 1, 1]))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one_row"):
        dummy_model(config).prepack_weights(one_row="fastest")


def test_one_row_steps_use_column_major_weights_and_equal_the_plain_model() -> None:
    # Tied head (Qwen3-style): the embedding keeps its rows; the head gets its own copy.
    config = small_qwen3_style()
    plain, packed = dummy_model(config), dummy_model(config)
    assert packed.prepack_weights(one_row="column-major")
    layer = packed.layers[0]
    for weight in (layer.self_attn.qkv_weight, layer.mlp.down_weight):
        assert weight.t().is_contiguous() and not weight.is_contiguous()
    assert packed.embed_tokens.is_contiguous()
    assert packed.one_row_lm_head is not None and packed.one_row_lm_head.t().is_contiguous()
    tokens = random_tokens(6, config.vocab_size, seed=3)
    steps = [2, 1, 1, 1, 1]  # a prompt, then one-row decode steps
    results = []
    for model in (plain, packed):
        pool = new_pool(model)
        results.append(run_in_steps(model, pool, tokens, SlotAllocator(pool).slots(6), steps))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)


def test_one_row_choice_on_one_thread_counts_only_the_threads_own_cpu_time() -> None:
    # Time the OS gives the core to other work (here: the thread sleeping) must not count,
    # or a busy machine at start-up picks the slower layout for the server's whole life.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        clock = one_row_clock()
        start = clock()
        time.sleep(0.2)
        assert clock() - start < 0.1
        torch.set_num_threads(2)
        assert one_row_clock() is time.perf_counter  # workers' spinning is not the cost
    finally:
        torch.set_num_threads(before)
