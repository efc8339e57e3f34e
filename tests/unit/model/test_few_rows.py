"""The few-row kernel over blocked weights equals the plain product, a row's result does
not depend on the rows beside it, and a model given blocked copies answers as the plain one,
using them only for products of a few rows."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from hicache.kernels import few_rows
from hicache.kernels.cpu_build import build_and_load
from hicache.kernels.few_rows import FEW_ROWS_MAX, block, few_rows_linear
from hicache.model.linear import linear
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

pytestmark = pytest.mark.skipif(
    few_rows._library() is None, reason="no C++ compiler for the few-row kernel"
)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 21])
@pytest.mark.parametrize(("n", "k"), [(64, 48), (160, 576), (300, 37)])
def test_products_equal_torch(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    blocked = block(weight)
    assert blocked is not None and blocked.shape == (-(-n // 16), k, 16)
    got = few_rows_linear(x, blocked, bias, out_features=n)
    assert got is not None and got.shape == (rows, n) and got.is_contiguous()
    # Against float64: summed over k in order in float32, within the rounding of K terms.
    exact = x.double() @ weight.T.double()
    tolerance = {"rtol": 1e-5, "atol": 2e-6 * k**0.5 * float(exact.abs().max())}
    torch.testing.assert_close(got.double(), exact + bias.double(), **tolerance)
    no_bias = few_rows_linear(x, blocked, out_features=n)
    assert no_bias is not None
    torch.testing.assert_close(no_bias.double(), exact, **tolerance)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    # A request decodes the same tokens alone or batched with others: bit for bit.
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 200, generator=gen)
    x = torch.randn(FEW_ROWS_MAX, 200, generator=gen)
    blocked = block(weight)
    assert blocked is not None
    together = few_rows_linear(x, blocked)
    assert together is not None
    for row in (0, 5, FEW_ROWS_MAX - 1):
        alone = few_rows_linear(x[row : row + 1], blocked)
        assert alone is not None and torch.equal(alone[0], together[row])


def test_strided_rows_and_threads_give_the_same_result() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 64, generator=gen)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 apart
    blocked = block(weight)
    assert blocked is not None
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = few_rows_linear(x, blocked)
            assert out is not None
            results.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], x @ weight.T, rtol=1e-5, atol=1e-5)
    # The model's linear takes the blocked copy as it takes a packed one.
    assert torch.equal(linear(x, blocked), results[0])


@pytest.mark.parametrize("rows", [1, 6, 16])
def test_bfloat16_products_are_those_of_float32_rounded_once(rows: int) -> None:
    # bfloat16 weights and rows, summed in float32: the exact float32 product of the
    # bfloat16 values, rounded to bfloat16 once (nearest even, as torch rounds).
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen).bfloat16()
    bias = torch.randn(200, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    blocked = block(weight)
    assert blocked is not None and blocked.dtype == torch.bfloat16
    got = few_rows_linear(x, blocked, bias, out_features=200)
    assert got is not None and got.dtype == torch.bfloat16
    exact = (x.double() @ weight.T.double() + bias.double())
    # Within one bfloat16 rounding of the exact value (float32 sums: far finer).
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
    reference = torch.nn.functional.linear(x, weight, bias)  # torch's bfloat16 GEMM
    torch.testing.assert_close(got, reference, rtol=2**-7, atol=2e-2)
    alone = few_rows_linear(x[-1:], blocked, bias, out_features=200)
    assert alone is not None and torch.equal(alone[0], got[-1])


def test_bfloat16_rounding_keeps_nans_and_rounds_to_even() -> None:
    # Two products summed in float32 land halfway between two bfloat16 values (whose
    # spacing at 1 is 2**-7): 1 + 2**-8 rounds to 1 (even), 1 + 3 * 2**-8 to 1 + 2**-6.
    weight = torch.zeros(16, 2, dtype=torch.bfloat16)
    weight[0] = torch.tensor([1.0, 2.0**-8])
    weight[1] = torch.tensor([1.0, 3 * 2.0**-8])
    weight[2, 0], weight[3, 0] = float("nan"), float("inf")
    blocked = block(weight)
    assert blocked is not None
    out = few_rows_linear(torch.ones(1, 2, dtype=torch.bfloat16), blocked)
    assert out is not None
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == 1.0 + 2.0**-6
    assert out[0, 2].isnan() and out[0, 3].isinf()
    assert torch.equal(out[0, :2], torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]).bfloat16())


def test_what_the_kernel_does_not_take_is_declined() -> None:
    assert block(torch.randn(16, 8, dtype=torch.float64)) is None
    assert block(torch.randn(16)) is None
    assert block(torch.randn(16, 8, device="meta")) is None
    blocked = block(torch.randn(16, 8))
    assert blocked is not None
    assert few_rows_linear(torch.randn(2, 8, dtype=torch.float64), blocked) is None


def _linear_calls(model: CausalLM, rows: int) -> tuple[int, int]:
    """oneDNN linear calls and few-row kernel calls of a forward of ``rows`` new tokens."""
    pool = new_pool(model)
    tokens = random_tokens(rows, model.config.vocab_size, seed=rows)
    slots = SlotAllocator(pool).slots(rows)
    calls = {"kernel": 0}
    real = few_rows._library()
    assert real is not None

    class Counting:
        def __getattr__(self, name: str) -> object:
            if name == "hicache_few_rows_linear":
                calls["kernel"] += 1
            return getattr(real, name)

    few_rows._LIBRARY.library = Counting()  # type: ignore[assignment]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_in_steps(model, pool, tokens, slots, [rows])
    finally:
        few_rows._LIBRARY.library = real
    onednn = sum(1 for event in prof.events() if "_linear_pointwise" in event.name)
    return onednn, calls["kernel"]


def test_a_model_with_blocked_copies_uses_them_for_few_rows_only_and_answers_the_same() -> None:
    # Qwen3-style: biases on q/k/v and o, qk-norm, a tied head of 300 rows (not a multiple
    # of the block: its product is cut to the vocabulary).
    config = small_qwen3_style()
    plain, blocked = dummy_model(config), dummy_model(config)
    assert blocked.prepack_weights(one_row="blocked")
    assert blocked.few_rows_lm_head is not None and blocked.packed_from_rows == 1
    layers = config.num_layers
    products = 4 * layers + 1  # qkv, o, gate_up, down per layer; the head
    assert _linear_calls(blocked, 1) == (0, products)
    assert _linear_calls(blocked, FEW_ROWS_MAX) == (0, products)
    assert _linear_calls(blocked, FEW_ROWS_MAX + 1) == (products, 0)  # the packed copies

    expected, _ = mixed_batch_vs_alone(plain, (6, 4), [5, 2, 12])
    got, alone = mixed_batch_vs_alone(blocked, (6, 4), [5, 2, 12])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alone, expected, atol=1e-4, rtol=1e-4)
    tokens = random_tokens(24, config.vocab_size, seed=4)
    results = []
    for model in (plain, blocked):
        pool = new_pool(model)
        results.append(run_in_steps(model, pool, tokens, SlotAllocator(pool).slots(24),
                                    [20, 1, 3]))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)


def test_blocking_releases_the_plain_weights_no_product_reads() -> None:
    # Every row count has a copy of its own (blocked up to FEW_ROWS_MAX, packed past it):
    # the plain projection weights go, their shapes stay, and what would read them refuses.
    config = dataclasses.replace(small_qwen3_style(), tie_word_embeddings=False)
    model = dummy_model(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert model.prepack_weights(one_row="blocked")
    layer = model.layers[0]
    released = [layer.self_attn.qkv_weight, layer.mlp.down_weight, model.lm_head_weight]
    for param in released:
        assert param.untyped_storage().nbytes() == param.element_size()
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    # What the model computes with instead: a packed and a blocked copy of each.
    assert len(model.weight_copies()) == 2 * (4 * config.num_layers + 1)
    assert model.embed_tokens.untyped_storage().nbytes() == model.embed_tokens.numel() * 4
    with pytest.raises(RuntimeError, match="released"):
        model.hf_weights()
    with pytest.raises(RuntimeError, match="released"):
        model.compile_blocks()
    # ... and it still answers as a model that kept them.
    plain = dummy_model(config)
    expected, _ = mixed_batch_vs_alone(plain, (20, 4), [5, 2])
    got, _ = mixed_batch_vs_alone(model, (20, 4), [5, 2])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    packed = dummy_model(config)
    assert packed.prepack_weights(one_row="packed")
    assert packed.layers[0].self_attn.qkv_weight.is_contiguous()  # kept where still read
    assert packed.hf_weights()


def test_blocked_is_refused_where_the_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(few_rows, "block_size", lambda: None)
    monkeypatch.setattr("hicache.model.model.block_size", lambda: None)
    model = dummy_model(small_qwen3_style())
    with pytest.raises(ValueError, match="few-row kernel"):
        model.prepack_weights(one_row="blocked")
    assert model.prepack_weights()  # auto: the one-row choice of before
    assert model.few_rows_lm_head is None and model.packed_from_rows in (1, 2)


def test_a_bfloat16_model_with_blocked_copies_answers_as_the_plain_one() -> None:
    config = dataclasses.replace(small_qwen3_style(), dtype=torch.bfloat16)
    plain, blocked = dummy_model(config), dummy_model(config)
    if not blocked.prepack_weights(one_row="packed"):
        pytest.skip("oneDNN cannot pack bfloat16 on this CPU")
    blocked = dummy_model(config)
    assert blocked.prepack_weights(one_row="blocked")
    assert blocked.few_rows_lm_head is not None
    assert blocked.few_rows_lm_head.dtype == torch.bfloat16
    expected, _ = mixed_batch_vs_alone(plain, (6, 4), [5, 2, 12])
    got, alone = mixed_batch_vs_alone(blocked, (6, 4), [5, 2, 12])
    # Logits of two bfloat16 models summing in other orders: bfloat16's tolerance.
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    torch.testing.assert_close(alone, expected, atol=0.05, rtol=0.02)


def test_bfloat16_without_avx512_bf16_gives_the_same_bits() -> None:
    # The same source built without the pairwise dot-product instruction (what a CPU
    # lacking AVX-512 BF16 runs) adds each pair's two exact products in the instruction's
    # order: bit for bit the same outputs.
    fallback = build_and_load(few_rows._SOURCE, (*few_rows._FLAGS, "-mno-avx512bf16"))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fallback.hicache_few_rows_linear_bf16.argtypes = [
        ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int,
    ]
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(48, 37, generator=gen).bfloat16()  # odd K: a padded last pair
    bias = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(11, 37, generator=gen).bfloat16()
    blocked = block(weight)
    assert blocked is not None
    native = few_rows_linear(x, blocked, bias)
    assert native is not None
    out = torch.empty(11, 48, dtype=torch.bfloat16)
    fallback.hicache_few_rows_linear_bf16(
        x.data_ptr(), x.stride(0), 11, blocked.data_ptr(), 37, 48, bias.data_ptr(),
        out.data_ptr(), out.stride(0), 1,
    )
    assert torch.equal(out, native)
