"""The one-pass CPU layer ops equal torch's versions, and step aside where they do not apply."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from hicache.kernels import cpu_layer_ops
from hicache.model.layer_blocks import swiglu
from hicache.model.norm import rms_norm
from hicache.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    cpu_layer_ops._library() is None, reason="no C++ compiler for the CPU layer ops"
)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("rows", [1, 4, 83, 300])
@pytest.mark.parametrize("dim", [64, 576, 4096])
def test_rms_norm_equals_torch(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen) * 5
    weight = torch.randn(dim, generator=gen)
    got = cpu_layer_ops.rms_norm(x, weight, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)
    assert torch.equal(rms_norm(x, weight, 1e-6), got)  # the model's norm takes this path


def test_rms_norm_reads_strided_rows() -> None:
    wide = torch.randn(7, 1000)
    x = wide[:, 100:676]  # rows 1000 apart
    weight = torch.randn(576)
    got = cpu_layer_ops.rms_norm(x, weight, 1e-5)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 4, 84])
def test_rotary_equals_torch_exactly_on_a_view_of_qkv(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15, 64, generator=gen)  # 9 q heads, 3 k, 3 v
    angles = torch.rand(tokens, 1, 32, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    x = qkv[:, :12]  # q and k: token stride 15 heads
    got = cpu_layer_ops.rotary(x, cos, sin)
    assert got is not None and got.shape == (tokens, 12, 64) and got.is_contiguous()
    assert torch.equal(got, torch_rotary(x, cos, sin))  # same products, same rounding
    assert torch.equal(apply_rotary(x, cos, sin), got)


def torch_rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's bfloat16 RMSNorm in torch: normalized in float32, rounded, weighted."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 8, 83])
@pytest.mark.parametrize("dim", [64, 576, 4096])
def test_bf16_rms_norm_rounds_where_torch_does(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    wide = (torch.randn(rows, dim + 40, generator=gen) * 5).bfloat16()
    x = wide[:, 40:]  # strided rows, as a view of the residual stream may be
    weight = torch.randn(dim, generator=gen).bfloat16()
    got = cpu_layer_ops.rms_norm(x, weight, 1e-5)
    assert got is not None and got.dtype == torch.bfloat16
    expected = torch_rms_norm_bf16(x, weight, 1e-5)
    # Only the mean of squares is summed in another order: a float32 ulp of the scale can
    # move a value across a bfloat16 rounding boundary, one bfloat16 ulp, very rarely.
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-5)
    assert (got == expected).float().mean() > 0.999
    assert torch.equal(rms_norm(x, weight, 1e-5), got)  # the model's norm takes this path


@pytest.mark.parametrize("tokens", [1, 4, 84])
def test_bf16_rotary_equals_torch_exactly(tokens: int) -> None:
    gen = torch.Generator().manual_seed(100 + tokens)
    qkv = torch.randn(tokens, 15, 64, generator=gen).bfloat16()
    angles = torch.rand(tokens, 1, 32, generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    x = qkv[:, :12]
    got = cpu_layer_ops.rotary(x, cos, sin)
    assert got is not None and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, torch_rotary(x, cos, sin))  # every rounding where torch's is
    assert torch.equal(apply_rotary(x, cos, sin), got)


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 8, 300, 1100])  # the last two split over threads
def test_silu_mul_equals_torch_within_its_exp(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * 1536 + 24, generator=gen) * 6
    gate_up = wide[:, 24:]  # strided rows, gate and up side by side
    got = cpu_layer_ops.silu_mul(gate_up)
    assert got is not None and got.shape == (rows, 1536) and got.is_contiguous()
    # The exp differs from torch's by an ulp or two: so may silu, never by more.
    torch.testing.assert_close(got, torch_swiglu(gate_up), rtol=1e-6, atol=1e-7)
    assert torch.equal(swiglu(gate_up), got)  # the model's SwiGLU takes this path
    # bfloat16: silu rounded, then the product, as torch's two ops round.
    half = gate_up.bfloat16()
    got16 = cpu_layer_ops.silu_mul(half)
    assert got16 is not None and got16.dtype == torch.bfloat16
    expected16 = torch_swiglu(half)
    torch.testing.assert_close(got16, expected16, rtol=8e-3, atol=1e-6)
    assert (got16 == expected16).float().mean() > 0.999


def test_silu_mul_at_the_ends_of_the_range() -> None:
    gate = torch.tensor([-1000.0, -100.0, -87.5, -20.0, 0.0, 20.0, 100.0, 1000.0, float("nan")])
    up = torch.full_like(gate, 3.0)
    for dtype in (torch.float32, torch.bfloat16):
        got = cpu_layer_ops.silu_mul(torch.cat([gate, up]).to(dtype).unsqueeze(0))
        assert got is not None
        expected = torch_swiglu(torch.cat([gate, up]).to(dtype).unsqueeze(0))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30, equal_nan=True)
        assert got[0, -1].isnan()


def test_ops_give_the_same_bits_on_one_thread_and_on_several() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen)
    heads = torch.randn(2048, 12, 64, generator=gen)
    angles = torch.rand(2048, 1, 32, generator=gen) * 100
    gate_up = torch.randn(2048, 3072, generator=gen) * 6
    threads = torch.get_num_threads()

    def run() -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            out += [cpu_layer_ops.rms_norm(x.to(dtype), weight.to(dtype), 1e-5),
                    cpu_layer_ops.rotary(heads.to(dtype), cos, sin),
                    cpu_layer_ops.silu_mul(gate_up.to(dtype))]
        return out

    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(max(2, threads))
        assert cpu_layer_ops._threads(x.numel()) >= 2  # these sizes do split
        split = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


def test_the_ops_step_aside_where_they_do_not_apply() -> None:
    x = torch.randn(4, 64)
    weight = torch.randn(64)
    assert cpu_layer_ops.rms_norm(x.half(), weight.half(), 1e-6) is None
    assert cpu_layer_ops.rms_norm(x.bfloat16(), weight, 1e-6) is None  # mixed dtypes
    assert cpu_layer_ops.rms_norm(x.view(4, 2, 32), weight[:32], 1e-6) is None  # per head
    assert cpu_layer_ops.rms_norm(x.t(), weight[:4], 1e-6) is None  # columns
    heads = torch.randn(4, 3, 64)
    cos, sin = torch.randn(4, 1, 32), torch.randn(4, 1, 32)
    assert cpu_layer_ops.rotary(heads.half(), cos.half(), sin.half()) is None
    assert cpu_layer_ops.rotary(heads, torch.randn(4, 1, 16), torch.randn(4, 1, 16)) is None
    assert cpu_layer_ops.silu_mul(torch.randn(4, 64).half()) is None
    assert cpu_layer_ops.silu_mul(torch.randn(4, 63)) is None  # no even split
    assert cpu_layer_ops.silu_mul(torch.randn(64, 4).t()) is None  # columns
    # The model's functions then run torch's ops, with the same results as always.
    hf = heads.half()
    assert torch.equal(apply_rotary(hf, cos.half(), sin.half()),
                       torch_rotary(hf, cos.half(), sin.half()))


def _generic_library() -> object:
    """The same source built without AVX512-BF16: the integer roundings throughout."""
    from hicache.kernels.cpu_build import build_and_load

    library = build_and_load(cpu_layer_ops._SOURCE, (*cpu_layer_ops._FLAGS, "-mno-avx512bf16"))
    assert library.hicache_layer_ops_bf16x16() == 0
    return library


def _bf16_ops(library: object, x: torch.Tensor, weight: torch.Tensor, heads: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, gate_up: torch.Tensor) -> list[torch.Tensor]:
    """The three bfloat16 ops of ``library`` (raw calls: the generic build has no argtypes)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    rows, dim = x.shape
    normed = torch.empty_like(x)
    library.hicache_rms_norm_bf16(  # type: ignore[attr-defined]
        ptr(x.data_ptr()), i64(dim), ptr(weight.data_ptr()), ptr(normed.data_ptr()), i64(dim),
        i64(rows), i64(dim), ctypes.c_float(1e-5), 2)
    tokens, count, head_dim = heads.shape
    rotated = torch.empty_like(heads)
    library.hicache_rotary_bf16(  # type: ignore[attr-defined]
        ptr(heads.data_ptr()), i64(count * head_dim), i64(head_dim), ptr(cos.data_ptr()),
        ptr(sin.data_ptr()), i64(head_dim // 2), ptr(rotated.data_ptr()), i64(tokens),
        i64(count), i64(head_dim // 2), 2)
    width = gate_up.shape[1] // 2
    swiglu_out = torch.empty(gate_up.shape[0], width, dtype=torch.bfloat16)
    library.hicache_silu_mul_bf16(  # type: ignore[attr-defined]
        ptr(gate_up.data_ptr()), i64(2 * width), ptr(swiglu_out.data_ptr()),
        i64(gate_up.shape[0]), i64(width), 2)
    return [normed, rotated, swiglu_out]


def _has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "avx512_bf16" in cpuinfo.read()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
def test_bf16_ops_round_with_the_cpus_bf16_instruction_where_it_has_one() -> None:
    library = cpu_layer_ops._library()
    assert library is not None and library.hicache_layer_ops_bf16x16() == 1


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("case", ["normal", "subnormal", "special"])
def test_bf16_ops_give_the_generic_builds_bits(case: str) -> None:
    """VCVTNEPS2BF16 reads subnormals as zero: rows that meet one are redone, so the bits are
    the integer rounding's on every input, subnormal results and NaN/inf included."""
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(40, 576 + 5, generator=gen) * 4  # a vector tail of 5 in each row
    weight = torch.randn(576 + 5, generator=gen)
    heads = torch.randn(40, 12, 64, generator=gen)
    angles = torch.rand(40, 1, 32, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    gate_up = torch.randn(40, 2 * 1536, generator=gen) * 6
    if case == "subnormal":  # products that land below 2^-126 in some rows, not others
        weight[::3] *= 1e-37
        x[::4] *= 1e-38
        heads[::5] *= 1e-20
        cos[::3] *= 1e-19
        sin[::3] *= 1e-19  # both: every product of those rows subnormal
        gate_up[::2, :1536] *= 1e-19
        gate_up[::3, 1536:] *= 1e-20
        gate_up[5, 7] = 1e-39  # a subnormal gate
    elif case == "special":
        for t in (x, heads, gate_up):
            flat = t.view(-1)
            flat[::97] = float("inf")
            flat[1::89] = float("-inf")
            flat[2::83] = float("nan")
            flat[3::79] = 0.0
            flat[4::73] = -0.0
            flat[5::71] = 3e38
    args = [t.bfloat16().contiguous() for t in (x, weight, heads, cos, sin, gate_up)]
    fast = _bf16_ops(cpu_layer_ops._library(), *args)
    generic = _bf16_ops(_generic_library(), *args)
    for a, b in zip(fast, generic, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    if case == "subnormal":  # the inputs did make subnormal results
        assert any(((t.float().abs() < 1.18e-38) & (t != 0)).any() for t in generic)
