"""Paged attention kernels on CUDA: Triton (and FlashInfer where installed) against the reference.

Model-sized shapes (head_dim 64/128, GQA up to 8:1, contexts of thousands of
tokens) on NaN-poisoned pools (see tests/attention_reference.py). Their speed is a
benchmark, not a test: ``hicache bench attention`` (scripts/gpu_check.sh's
bench_attention step) times every backend on the same decode and extend shapes.
"""

from __future__ import annotations

import random

import pytest
import torch

from hicache.attention import triton as triton_attention
from hicache.kernels import flashinfer_available
from tests.attention_reference import (
    TOLERANCE,
    PagedBatch,
    make_batch,
    max_error,
    reference_attention,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (heads, kv_heads, head_dim): Llama-3-8B (GQA 4:1), SmolLM2-135M (3:1), MHA, 8:1.
_SHAPES = [(32, 8, 128), (9, 3, 64), (16, 16, 64), (64, 8, 128)]


def _mixed_batch(
    heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, seed: int
) -> PagedBatch:
    """Cold prefills, prefixes with new tokens (some over several query blocks), decodes."""
    rng = random.Random(seed)
    seq_lens, extend_lens = [], []
    for kind in ["cold", "prefix", "decode", "prefix", "decode", "cold", "prefix", "decode"]:
        length = rng.randint(1, 2000)
        extend = {"cold": length, "decode": 1, "prefix": rng.randint(1, min(length, 300))}[kind]
        seq_lens.append(length)
        extend_lens.append(extend)
    return make_batch(
        seq_lens, extend_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, dtype=dtype, seed=seed, device="cuda",
    )


def _decode_batch(
    heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, seed: int,
    batch_size: int = 16, max_len: int = 4000,
) -> PagedBatch:
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, max_len) for _ in range(batch_size)]
    return make_batch(
        seq_lens, [1] * batch_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, dtype=dtype, seed=seed, device="cuda",
    )


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_triton_extend_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], page_size: int
) -> None:
    batch = _mixed_batch(*shape, page_size, dtype, seed=page_size + shape[0])
    out = triton_attention.extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens,
        batch.qo_indptr, batch.max_extend_len, batch.page_size,
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_triton_decode_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], page_size: int, num_splits: int | None
) -> None:
    batch = _decode_batch(*shape, page_size, dtype, seed=page_size * 7 + shape[1])
    out = triton_attention.decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens,
        batch.page_size, num_splits=num_splits,
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[dtype]


def test_small_decode_batches_of_long_contexts_are_split() -> None:
    # 2 sequences x 8 KV heads = 16 programs: far fewer than an H100's 132 SMs.
    assert triton_attention._auto_splits(16, 8192, torch.device("cuda")) > 1
    batch = _decode_batch(32, 8, 128, 16, torch.bfloat16, seed=3, batch_size=2, max_len=8192)
    out = triton_attention.decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 16
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[torch.bfloat16]


def test_triton_decode_replays_in_a_cuda_graph() -> None:
    """No launch reads a length back to the host: captured once, replayed on new lengths."""
    batch = _decode_batch(32, 8, 128, 16, torch.float16, seed=5, batch_size=8, max_len=3000)
    seq_lens = batch.seq_lens.clone()
    out = torch.empty_like(batch.q)

    def step() -> None:
        triton_attention.decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.page_table, seq_lens, 16,
            max_seq_len=3000, num_splits=4, out=out,
        )

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    shorter = torch.clamp(batch.seq_lens - 500, min=1).to(torch.int32)
    seq_lens.copy_(shorter)
    graph.replay()
    expected = reference_attention(
        PagedBatch(batch.q, batch.k_cache, batch.v_cache, batch.page_table, shorter,
                   batch.qo_indptr, 16, 1)
    )
    assert max_error(out, expected) <= TOLERANCE[torch.float16]


# ---- FlashInfer ------------------------------------------------------------------------

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (64, 8, 128)],
                         ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_flashinfer_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], page_size: int
) -> None:
    from hicache.attention import flashinfer as flashinfer_attention

    batch = _mixed_batch(*shape, page_size, dtype, seed=11)
    out = flashinfer_attention.extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens,
        batch.qo_indptr, batch.max_extend_len, batch.page_size,
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[dtype]
    batch = _decode_batch(*shape, page_size, dtype, seed=12)
    out = flashinfer_attention.decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, page_size
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[dtype]
