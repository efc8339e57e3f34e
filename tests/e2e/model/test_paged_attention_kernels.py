"""The attention kernel modules without a GPU: they import without Triton or FlashInfer,
say why they cannot run, and refuse malformed inputs before launching anything.

(The kernels' results are checked in the interpreter: test_paged_attention_interpreter.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.attention.triton import (
    AttentionKernelUnavailableError,
    decode_attention,
    extend_attention,
)
from hicache.kernels.availability import (
    flashinfer_unavailable_reason,
    triton_available,
    triton_unavailable_reason,
)
from tests.attention_reference import PagedBatch, make_batch

_ROOT = Path(__file__).resolve().parents[3]


def test_importing_the_kernel_modules_imports_no_gpu_library() -> None:
    code = (
        "import sys\n"
        "import hicache.attention.triton, hicache.attention.flashinfer\n"
        "print(sorted(m for m in ('triton', 'flashinfer') if m in sys.modules))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=120,
        check=True,
    )
    assert child.stdout.strip() == "[]"


@pytest.fixture
def batch() -> PagedBatch:
    return make_batch(
        [10, 3], [2, 3], heads=4, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float16,
        seed=0,
    )


def test_cpu_tensors_need_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, batch: PagedBatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_available("cpu")
    reason = triton_unavailable_reason("cpu")
    assert reason is not None
    with pytest.raises(AttentionKernelUnavailableError, match=r"TRITON_INTERPRET|not installed"):
        extend_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens,
            batch.qo_indptr, batch.max_extend_len, batch.page_size,
        )


def test_without_triton_the_kernels_say_so(
    monkeypatch: pytest.MonkeyPatch, batch: PagedBatch
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now fails
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_unavailable_reason("cpu") == "Triton is not installed"
    with pytest.raises(AttentionKernelUnavailableError, match="Triton is not installed"):
        decode_attention(
            batch.q[:2], batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 4
        )


def test_flashinfer_never_runs_on_the_cpu() -> None:
    reason = flashinfer_unavailable_reason("cpu")
    assert reason is not None
    assert "CUDA" in reason or "not installed" in reason


def _extend(batch: PagedBatch, **changes: object) -> None:
    args: dict[str, object] = dict(
        q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, page_table=batch.page_table,
        seq_lens=batch.seq_lens, qo_indptr=batch.qo_indptr, max_extend_len=batch.max_extend_len,
        page_size=batch.page_size,
    )
    args.update(changes)
    extend_attention(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {"q": b.q[:, :3]}, "cannot share"),
        (lambda b: {"q": b.q.float()}, "must share one of"),
        (lambda b: {"q": b.q[..., :8]}, "head_dim"),
        (lambda b: {"v_cache": b.v_cache[:-1]}, "k/v caches"),
        (lambda b: {"page_size": 3}, "whole pages"),
        (lambda b: {"qo_indptr": b.qo_indptr[:-1]}, "qo_indptr must be"),
        (lambda b: {"page_table": b.page_table[:1]}, "rows for 2 sequences"),
        (lambda b: {"seq_lens": b.seq_lens.float()}, "int32 or int64"),
        (lambda b: {"out": torch.empty_like(b.q[:1])}, "out must be like q"),
    ],
)
def test_malformed_inputs_are_refused_before_any_launch(
    batch: PagedBatch, change: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _extend(batch, **change(batch))  # type: ignore[operator]


def test_decode_refuses_more_splits_than_it_merges(batch: PagedBatch) -> None:
    q = batch.q[:2]
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(
            q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 4, num_splits=65
        )
