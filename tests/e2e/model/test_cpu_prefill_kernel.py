"""The CPU prefill kernel (``cpu.paged_prefill``) equals attention computed in float64, reads
contexts in place through shuffled page tables, does not depend on how a prompt is chunked,
and is what the CPU backend runs for prompts (SDPA where the kernel does not load). bf16
prompts take the widest path the CPU has (AMX tiles, AVX512-BF16, float32 tiles): the tests
run on that path, and those of bf16 again with AMX off, so both stay checked on an AMX CPU.

Pools come from ``tests.attention_reference.make_batch``: every slot a kernel must not read
is NaN, so a read past a context (or of a stale table entry) shows in the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import hicache.attention.cpu as cpu
from hicache.attention.cpu import CpuPagedBackend, paged_prefill
from hicache.attention.gather import GatherBackend
from hicache.model.batch import ForwardBatch
from tests.attention_reference import PagedBatch, make_batch

# Against float64 attention over the same (rounded) inputs: float32 sums of up to a few
# hundred terms; bf16/fp16 round the output (and, in SDPA, P) to their precision.
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def _float64_reference(batch: PagedBatch) -> torch.Tensor:
    """SDPA in float64 of each sequence's new rows over its context (lower-right causal)."""
    q = batch.q.double()
    out = torch.empty_like(q)
    bounds = batch.qo_indptr.tolist()
    for b, total in enumerate(batch.seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        pos = torch.arange(total)
        slots = batch.page_table[b, pos // batch.page_size].long() * batch.page_size + (
            pos % batch.page_size)
        k = batch.k_cache[slots].double().transpose(0, 1)[None]
        v = batch.v_cache[slots].double().transpose(0, 1)[None]
        mask = pos[None, :] <= pos[total - (end - start) :, None]
        got = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
        out[start:end] = got[0].transpose(0, 1)
    return out


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
HAS_AMX = {"amx_tile", "amx_bf16", "avx512_bf16"} <= FLAGS
WITHOUT_AMX = "avx512_bf16" if "avx512_bf16" in FLAGS else "float32"


@pytest.fixture(params=[True, False], ids=["widest", "amx-off"])
def amx(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Each bf16 test once on the CPU's widest path and once with AMX off (the same path
    where the CPU has no AMX)."""
    previous = cpu.set_prefill_amx(request.param)
    try:
        yield bool(request.param)
    finally:
        cpu.set_prefill_amx(previous)


def _run_kernel(batch: PagedBatch) -> torch.Tensor:
    starts = batch.qo_indptr[:-1].contiguous()
    extends = (batch.qo_indptr[1:] - batch.qo_indptr[:-1]).contiguous()
    return paged_prefill(batch.q, batch.k_cache, batch.v_cache, batch.page_table, starts,
                         extends, batch.seq_lens, batch.page_size)


# (seq_lens, extend_lens): lengths on and off the kernel's blocks (32 queries, 64 keys).
CASES = {
    "cold": ([300], [300]),
    "cold-short": ([5], [5]),
    "prefix": ([1000], [232]),
    "prefix-unaligned": ([261], [70]),
    "several": ([64, 130, 97, 40], [64, 3, 97, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Its task size follows the thread count (fewer, larger tasks for fewer threads).
@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_kernel_equals_float64_attention(
    case: str, page_size: int, heads: tuple[int, int], dtype: torch.dtype, threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    seq_lens, extend_lens = CASES[case]
    batch = make_batch(seq_lens, extend_lens, heads=heads[0], kv_heads=heads[1], head_dim=64,
                       page_size=page_size, dtype=dtype, seed=page_size + threads)
    got = _run_kernel(batch)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), _float64_reference(batch), **TOL[dtype])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
def test_bf16_prompts_on_either_path_equal_float64_attention(
    case: str, heads: tuple[int, int], amx: bool
) -> None:
    seq_lens, extend_lens = CASES[case]
    batch = make_batch(seq_lens, extend_lens, heads=heads[0], kv_heads=heads[1], head_dim=64,
                       page_size=16, dtype=torch.bfloat16, seed=len(case))
    torch.testing.assert_close(_run_kernel(batch).double(), _float64_reference(batch),
                               **TOL[torch.bfloat16])


def test_bf16_prompts_take_the_widest_path_the_cpu_has() -> None:
    assert cpu.prefill_bf16_path() == ("amx" if HAS_AMX else WITHOUT_AMX)
    previous = cpu.set_prefill_amx(False)
    try:
        assert previous == HAS_AMX
        assert cpu.prefill_bf16_path() == WITHOUT_AMX
    finally:
        cpu.set_prefill_amx(previous)
    assert cpu.prefill_bf16_path() == ("amx" if HAS_AMX else WITHOUT_AMX)


@pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX")
def test_the_environment_turns_amx_off() -> None:
    code = "import hicache.attention.cpu as c; print(c.prefill_bf16_path())"
    env = {**os.environ, cpu.AMX_ENV: "0"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert got.stdout.split()[-1] == WITHOUT_AMX


@pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX")
@pytest.mark.parametrize(("seq_len", "extend"), [(1024, 1024), (1000, 232), (97, 40)])
def test_amx_and_avx512_bf16_are_equally_close_to_float64(seq_len: int, extend: int) -> None:
    # Both multiply the same bf16 pairs into float32 sums and round the softmax weights to
    # bf16 alike; only the order of the float32 additions differs.
    batch = make_batch([seq_len], [extend], heads=9, kv_heads=3, head_dim=64, page_size=16,
                       dtype=torch.bfloat16, seed=extend)
    exact = _float64_reference(batch)
    on_tiles = _run_kernel(batch)
    previous = cpu.set_prefill_amx(False)
    try:
        off_tiles = _run_kernel(batch)
    finally:
        cpu.set_prefill_amx(previous)
    tiles_error = (on_tiles.double() - exact).abs()
    vector_error = (off_tiles.double() - exact).abs()
    assert float(tiles_error.mean()) <= 1.1 * float(vector_error.mean())
    assert float(tiles_error.max()) <= 1.5 * float(vector_error.max())


# 160: past the AMX path's four tiles of a head (its prompts run on AVX512-BF16).
@pytest.mark.parametrize("head_dim", [16, 33, 36, 128, 160])
# bf16 (with AVX512-BF16) multiplies pairs of dimensions: an odd head size has half a pair.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_takes_head_sizes_off_its_tiles(
    head_dim: int, dtype: torch.dtype, amx: bool
) -> None:
    batch = make_batch([150, 77], [90, 77], heads=6, kv_heads=2, head_dim=head_dim,
                       page_size=4, dtype=dtype, seed=head_dim)
    torch.testing.assert_close(_run_kernel(batch).double(), _float64_reference(batch),
                               **TOL[dtype])


@pytest.mark.parametrize(("seq_len", "extend"), [(1024, 1024), (1000, 232)])
def test_prefill_kernel_in_bf16_is_as_close_as_sdpa_in_bf16(seq_len: int, extend: int) -> None:
    # With AVX512-BF16 the kernel rounds the softmax weights to bf16 before multiplying the
    # values (as torch's SDPA in bf16 does); without it, it multiplies in float32. Either
    # way its error against float64 stays that of SDPA's in bf16 over the same inputs.
    batch = make_batch([seq_len], [extend], heads=9, kv_heads=3, head_dim=64, page_size=16,
                       dtype=torch.bfloat16, seed=2)
    exact = _float64_reference(batch)
    pos = torch.arange(seq_len)
    slots = batch.page_table[0, pos // 16].long() * 16 + pos % 16
    sdpa = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1)[None], batch.k_cache[slots].transpose(0, 1)[None],
        batch.v_cache[slots].transpose(0, 1)[None],
        attn_mask=pos[None, :] <= pos[seq_len - extend :, None], enable_gqa=True,
    )[0].transpose(0, 1)
    sdpa_error = (sdpa.double() - exact).abs()
    kernel_error = (_run_kernel(batch).double() - exact).abs()
    assert float(kernel_error.mean()) <= 1.1 * float(sdpa_error.mean())
    assert float(kernel_error.max()) <= 1.5 * float(sdpa_error.max())


@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0, 400.0])
def test_prefill_softmax_holds_over_the_whole_range_of_scores(spread: float) -> None:
    # Scores from nearly equal to far apart (most weights below float's range: 0), and a
    # running maximum that changes from one key block to the next. Large scores carry
    # float32's rounding (relative to their size) into the weights whatever computes them:
    # the kernel stays as close to float64 as torch's SDPA in float32 does.
    batch = make_batch([200], [150], heads=9, kv_heads=3, head_dim=32, page_size=16,
                       dtype=torch.float32, seed=5)
    batch = PagedBatch(batch.q * spread, batch.k_cache, batch.v_cache, batch.page_table,
                       batch.seq_lens, batch.qo_indptr, batch.page_size, batch.max_extend_len)
    exact = _float64_reference(batch)
    pos = torch.arange(200)
    slots = batch.page_table[0, pos // 16].long() * 16 + pos % 16
    sdpa = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1)[None], batch.k_cache[slots].transpose(0, 1)[None],
        batch.v_cache[slots].transpose(0, 1)[None],
        attn_mask=pos[None, :] <= pos[50:, None], enable_gqa=True)[0].transpose(0, 1)
    sdpa_error = float((sdpa.double() - exact).abs().max())
    kernel_error = float((_run_kernel(batch).double() - exact).abs().max())
    assert kernel_error <= 2 * sdpa_error + 1e-6, (kernel_error, sdpa_error)


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_computes_exactly_what_the_whole_prompt_does(
    threads: int, dtype: torch.dtype, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Key blocks start at absolute positions, so a query sums its keys in the same order
    # however its prompt was cut: a cached or chunked prefill equals the cold one bit for
    # bit (here chunks on and off the blocks, with another thread count for the cold run).
    # bf16 too (with AVX512-BF16 or AMX: keys multiplied in pairs, pairs within the blocks).
    batch = make_batch([700], [700], heads=9, kv_heads=3, head_dim=64, page_size=16,
                       dtype=dtype, seed=11)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cold = _run_kernel(batch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for lo, hi in [(0, 100), (100, 229), (229, 256), (256, 257), (257, 700)]:
        chunk = PagedBatch(batch.q[lo:hi], batch.k_cache, batch.v_cache, batch.page_table,
                           torch.tensor([hi], dtype=torch.int32),
                           torch.tensor([0, hi - lo], dtype=torch.int32), batch.page_size,
                           hi - lo)
        assert torch.equal(_run_kernel(chunk), cold[lo:hi]), (lo, hi)


def _forward_batch(extend_lens: list[int], seq_lens: list[int], page_size: int,
                   seed: int) -> ForwardBatch:
    """A step whose sequences own shuffled pages, in shuffled rows of a wider table."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 3 * sum(-(-n // page_size) for n in seq_lens)
    pages = torch.randperm(num_pages, generator=gen)
    width = max(-(-n // page_size) for n in seq_lens) + 2
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[: len(seq_lens)]
    table = torch.full((len(seq_lens) + 3, width), -1, dtype=torch.int32)
    used = 0
    positions: list[int] = []
    out_slots: list[int] = []
    for row, extend, total in zip(rows.tolist(), extend_lens, seq_lens, strict=True):
        need = -(-total // page_size)
        table[row, :need] = pages[used : used + need].to(torch.int32)
        used += need
        for pos in range(total - extend, total):
            positions.append(pos)
            out_slots.append(int(table[row, pos // page_size]) * page_size + pos % page_size)
    return ForwardBatch(
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.tensor(positions), out_slots=torch.tensor(out_slots),
        extend_lens=tuple(extend_lens), seq_lens=tuple(seq_lens), page_table=table,
        table_rows=rows.to(torch.int32), page_size=page_size,
    )


def _step_tensors(batch: ForwardBatch, heads: int, kv_heads: int, head_dim: int,
                  slots: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    qkv = torch.randn(batch.num_tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
    k_cache.index_copy_(0, batch.out_slots, k)
    v_cache.index_copy_(0, batch.out_slots, v)
    return q, k, v, k_cache, v_cache


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_cpu_backend_runs_prompts_in_the_kernel(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several prompts (cold, over a prefix) beside decode rows: one kernel call for the
    # prompts, none of SDPA's paths.
    calls: list[int] = []
    kernel = cpu.paged_prefill

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(int(args[4].shape[0]))  # type: ignore[attr-defined]
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a prompt went to SDPA")

    monkeypatch.setattr(cpu, "paged_prefill", counted)
    monkeypatch.setattr(cpu, "causal_attention", forbidden)
    monkeypatch.setattr(cpu, "_with_context", forbidden)
    batch = _forward_batch([1, 40, 1, 130, 7], [90, 40, 3, 200, 71], page_size, seed=4)
    slots = 3 * sum(-(-n // page_size) for n in batch.seq_lens) * page_size
    q, k, v, k_cache, v_cache = _step_tensors(batch, 9, 3, 64, slots)
    got = CpuPagedBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    assert calls == [3]
    expected = GatherBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


def test_prompts_keep_sdpa_where_the_kernel_does_not_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu, "load_cpu_kernel", lambda: None)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(cpu, "paged_prefill", forbidden)
    sdpa_calls: list[str] = []
    for name in ("causal_attention", "_with_context"):
        original = getattr(cpu, name)

        def counted(*args: object, _name: str = name, _f: object = original) -> torch.Tensor:
            sdpa_calls.append(_name)
            return _f(*args)  # type: ignore[operator, no-any-return]

        monkeypatch.setattr(cpu, name, counted)
    batch = _forward_batch([40, 33], [40, 100], 16, seed=8)
    q, k, v, k_cache, v_cache = _step_tensors(batch, 9, 3, 64, 3 * 9 * 16)
    got = CpuPagedBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    assert sdpa_calls == ["causal_attention", "_with_context"]
    expected = GatherBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])
