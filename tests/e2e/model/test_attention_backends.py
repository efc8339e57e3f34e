"""Every attention backend that runs here equals the reference (gather) backend.

Batches mix cold prompts, prompts over a cached context, and decodes, over pages
scattered through the pool (as a long-running server leaves them), with grouped
KV heads, in each dtype the engine serves.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hicache.attention.backend import make_attention_backend
from hicache.attention.cpu import CpuPagedBackend
from hicache.attention.gather import GatherBackend
from hicache.config import ConfigError
from hicache.model.batch import ForwardBatch

# A fresh interpreter importing torch: seconds when quiet, minutes on a loaded machine. Only
# a guard against a hang, not a bound on the start.
SUBPROCESS_HANG_GUARD_S = 600

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def _paged_batch(
    extend_lens: list[int], seq_lens: list[int], page_size: int, num_pages: int, seed: int
) -> ForwardBatch:
    """A batch whose sequences own shuffled pages, in shuffled rows of a wider table."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=gen)
    width = max(-(-n // page_size) for n in seq_lens) + 2
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[: len(seq_lens)]
    table = torch.full((len(seq_lens) + 3, width), -1, dtype=torch.int32)  # never read
    next_page = 0
    positions: list[int] = []
    out_slots: list[int] = []
    for row, extend, total in zip(rows.tolist(), extend_lens, seq_lens, strict=True):
        need = -(-total // page_size)
        table[row, :need] = pages[next_page : next_page + need].to(torch.int32)
        next_page += need
        for pos in range(total - extend, total):
            positions.append(pos)
            out_slots.append(int(table[row, pos // page_size]) * page_size + pos % page_size)
    num_tokens = sum(extend_lens)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions), out_slots=torch.tensor(out_slots),
        extend_lens=tuple(extend_lens), seq_lens=tuple(seq_lens), page_table=table,
        table_rows=rows.to(torch.int32), page_size=page_size,
    )


MIXES = {
    "decode": ([1, 1, 1, 1], [1, 37, 16, 200]),
    "cold": ([23], [23]),
    "prefix": ([9], [70]),
    "mixed": ([1, 12, 1, 5, 30], [90, 12, 3, 41, 64]),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
# The kernel takes a sequence per task when there are at least as many as threads, else a
# (sequence, KV head) per task: with 3 threads "decode" (4 sequences) takes the first,
# "mixed" (2 decoding) the second.
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_backend_equals_reference(
    mix: str, page_size: int, dtype: torch.dtype, heads: tuple[int, int], threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel runs as many OpenMP threads as torch's count says.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    num_heads, num_kv_heads = heads
    _assert_cpu_equals_reference(
        mix, page_size, dtype, (num_heads, num_kv_heads, 32), batch_seed=page_size, data_seed=1
    )


def _assert_cpu_equals_reference(
    mix: str, page_size: int, dtype: torch.dtype, shape: tuple[int, int, int],
    batch_seed: int, data_seed: int,
) -> None:
    """The CPU backend's output for ``mix`` equals the gather backend's, heads ``shape``
    (query heads, KV heads, head size)."""
    extend_lens, seq_lens = MIXES[mix]
    num_heads, num_kv_heads, head_dim = shape
    num_pages = 4 * sum(-(-n // page_size) for n in seq_lens)
    batch = _paged_batch(extend_lens, seq_lens, page_size, num_pages, seed=batch_seed)
    gen = torch.Generator().manual_seed(data_seed)
    kv_shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(kv_shape, generator=gen).to(dtype)
    v_cache = torch.randn(kv_shape, generator=gen).to(dtype)
    # q/k/v as the model makes them: views into one fused projection (strided rows).
    qkv = torch.randn(batch.num_tokens, num_heads + 2 * num_kv_heads, head_dim,
                      generator=gen).to(dtype)
    q, k, v = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    k_cache.index_copy_(0, batch.out_slots, k)
    v_cache.index_copy_(0, batch.out_slots, v)
    expected = GatherBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    got = CpuPagedBackend().prepare(batch).attend(q, k, v, k_cache, v_cache)
    torch.testing.assert_close(got, expected, **TOL[dtype])


# Decode rows of the head shapes the kernel has code of fixed shape for (head sizes 32, 64
# and 128, up to 4 query heads a KV head: SmolLM2's (3, 64), Qwen3's (2, 128), Llama's
# (4, 128)) and of shapes it does not (5 a KV head, head size 48), which take the general
# code: each equals the reference, one task a sequence or a KV head.
@pytest.mark.parametrize("mix", ["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [(9, 3, 64), (16, 8, 128), (4, 4, 128), (8, 2, 128), (10, 2, 64), (6, 2, 48)],
    ids=["g3-d64", "g2-d128", "g1-d128", "g4-d128", "g5-d64-general", "g3-d48-general"],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_decode_equals_reference_for_every_head_shape(
    mix: str, dtype: torch.dtype, shape: tuple[int, int, int], threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    _assert_cpu_equals_reference(
        mix, 16, dtype, shape, batch_seed=shape[2], data_seed=shape[2] + shape[0]
    )


@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0, 400.0])
def test_cpu_decode_softmax_holds_over_the_whole_range_of_scores(spread: float) -> None:
    # The kernel's own exp: scores spread from nearly equal (weights near 1) to far apart
    # (most weights below float's range, 0), against the softmax computed in float64.
    # Every output is within float32's tolerance of it, or, where the scores are so large
    # that rounding them in float32 moves the weights further (spread 400: scores in the
    # thousands, an ulp of 2e-4), no further than a few times torch's own float32 softmax.
    gen = torch.Generator().manual_seed(7)
    batch = _paged_batch([1, 1], [300, 45], 16, 64, seed=3)
    shape = (64 * 16, 3, 32)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    q = torch.randn(2, 9, 32, generator=gen) * spread

    def attend(backend: GatherBackend | CpuPagedBackend, dtype: torch.dtype) -> torch.Tensor:
        qd, kd, vd = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        return backend.prepare(batch).attend(qd, qd[:, :3], qd[:, :3], kd, vd).double()

    exact = attend(GatherBackend(), torch.float64)
    torch_error = (attend(GatherBackend(), torch.float32) - exact).abs().max().item()
    got = attend(CpuPagedBackend(), torch.float32)
    tol = TOL[torch.float32]
    torch.testing.assert_close(
        got, exact, rtol=tol["rtol"], atol=max(tol["atol"], 4 * torch_error)
    )


def test_auto_picks_the_cpu_backend_where_it_builds() -> None:
    assert make_attention_backend("auto", "cpu").name == "cpu"
    assert make_attention_backend("gather", "cpu").name == "gather"


def test_auto_falls_back_to_gather_without_the_kernel() -> None:
    # A fresh process: whether the kernel loads is decided once per process.
    code = (
        "from hicache.attention.backend import make_attention_backend as m\n"
        "print(m('auto', 'cpu').name)\n"
        "try:\n    m('cpu', 'cpu')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {"HICACHE_DISABLE_CPU_KERNEL": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": ":".join(sys.path)},
                          timeout=SUBPROCESS_HANG_GUARD_S,
                          check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "gather"
    assert lines[1].startswith("ConfigError") and "HICACHE_DISABLE_CPU_KERNEL" in lines[1]


def test_unknown_or_misplaced_backends_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown attention backend"):
        make_attention_backend("fast", "cpu")
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        make_attention_backend("cpu", "meta")
    # The GPU backends name why they cannot run on the CPU (no CUDA, no interpreter).
    if not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ConfigError, match=r"triton.*cannot run on cpu"):
            make_attention_backend("triton", "cpu")
    with pytest.raises(ConfigError, match=r"flashinfer.*cannot run on cpu"):
        make_attention_backend("flashinfer", "cpu")
