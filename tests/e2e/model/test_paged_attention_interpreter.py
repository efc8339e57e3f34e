"""The Triton paged attention kernels run by Triton's CPU interpreter, against the reference.

``TRITON_INTERPRET=1`` must be set before a kernel is defined and applies to the
whole process, so the cases run in one child process (this module run with
``python -m``), which prints one JSON object: case id -> None (match) or what
went wrong. Each parametrized test then checks its own case's outcome.

Batches (see tests/attention_reference.py) sit on shuffled pages of a real
device pool with NaN wherever a kernel must not read; shapes are small so the
interpreter stays quick: head_dim 16..64, contexts up to 100 tokens. Extend
batches mix cold prefills, prefixes with several new tokens (past one 64-row
query block), and single-token rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.attention_reference import (
    DTYPES,
    TOLERANCE,
    make_batch,
    max_error,
    reference_attention,
)

pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Case:
    kind: str  # "extend" or "decode"
    dtype: str
    page_size: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]  # all 1 for decode
    num_splits: int | None = None  # decode only
    scale: float | None = None
    strided: bool = False  # q a slice of a wider qkv tensor, int64 indices, an out= buffer
    max_seq_len: int | None = None  # decode only: the host-side bound handed over

    @property
    def id(self) -> str:
        splits = "" if self.num_splits is None else f"-s{self.num_splits}"
        scale = "" if self.scale is None else "-scaled"
        strided = "-strided" if self.strided else ""
        bound = "" if self.max_seq_len is None else f"-max{self.max_seq_len}"
        return (
            f"{self.kind}-{self.dtype}-p{self.page_size}-h{self.heads}kv{self.kv_heads}"
            f"-d{self.head_dim}{splits}{scale}{strided}{bound}"
        )


def _decode(
    dtype: str, page_size: int, heads: int, kv_heads: int, head_dim: int,
    seq_lens: tuple[int, ...], num_splits: int | None = None, scale: float | None = None,
    strided: bool = False, max_seq_len: int | None = None,
) -> Case:
    extend_lens = (1,) * len(seq_lens)
    return Case(
        "decode", dtype, page_size, heads, kv_heads, head_dim, seq_lens, extend_lens,
        num_splits, scale, strided, max_seq_len,
    )


# Context lengths on and around page boundaries (16, 64), 1 (the new token alone),
# and 100 (two key blocks of 64).
_CASES: list[Case] = [
    # Extend: (context, new) = cold prefill (new == context), prefix + several new,
    # decode rows; 70 new tokens span two query blocks.
    Case("extend", "fp32", 16, 4, 4, 32, (37, 1, 100, 64), (5, 1, 70, 64)),
    Case("extend", "fp16", 1, 9, 3, 64, (20, 45, 80), (20, 1, 17)),
    Case("extend", "bf16", 64, 8, 2, 16, (100, 64, 65), (36, 1, 65)),
    Case("extend", "fp16", 16, 8, 1, 32, (16, 17, 3), (16, 2, 3)),
    Case("extend", "bf16", 1, 4, 4, 64, (33, 9), (1, 9)),
    Case("extend", "fp32", 64, 9, 3, 64, (90, 1), (30, 1), scale=0.3),
    Case("extend", "fp16", 16, 6, 2, 32, (50, 18), (7, 18), strided=True),
    # Decode, one split (the CPU default) and several: 3 splits of a 100-key bound
    # leave sequences of 1 or 16 keys with empty splits.
    _decode("fp32", 16, 4, 4, 32, (1, 16, 17, 100)),
    _decode("fp32", 16, 4, 4, 32, (1, 16, 17, 100), num_splits=3),
    _decode("fp16", 1, 9, 3, 64, (64, 5, 99)),
    _decode("fp16", 1, 9, 3, 64, (64, 5, 99), num_splits=2),
    _decode("bf16", 64, 8, 2, 16, (65, 64, 1)),
    _decode("bf16", 64, 8, 2, 16, (65, 64, 1), num_splits=4),
    _decode("fp16", 16, 8, 1, 64, (40, 100), num_splits=3, scale=0.2),
    _decode("bf16", 16, 6, 2, 32, (30, 70), num_splits=2, strided=True),
    # A bound below the real lengths: 2 splits of 64 keys, the last one runs to 150.
    _decode("fp16", 16, 4, 2, 16, (150, 20), num_splits=2, max_seq_len=70),
]


def _run_case(case: Case) -> str | None:
    from hicache.attention.triton import decode_attention, extend_attention

    dtype = DTYPES[case.dtype]
    try:
        batch = make_batch(
            list(case.seq_lens), list(case.extend_lens), heads=case.heads,
            kv_heads=case.kv_heads, head_dim=case.head_dim, page_size=case.page_size,
            dtype=dtype, seed=zlib.crc32(case.id.encode()),
        )
        q, page_table, seq_lens, qo_indptr = (
            batch.q, batch.page_table, batch.seq_lens, batch.qo_indptr
        )
        out = None
        if case.strided:
            # q as the model slices it out of a fused qkv projection: rows further apart.
            qkv = torch.randn(q.shape[0], q.shape[1] + 2 * case.kv_heads, case.head_dim)
            qkv = qkv.to(dtype)
            qkv[:, : case.heads] = q
            q = qkv[:, : case.heads]
            page_table, seq_lens, qo_indptr = page_table.long(), seq_lens.long(), qo_indptr.long()
            out = torch.full_like(batch.q, float("nan"))
        if case.kind == "extend":
            result = extend_attention(
                q, batch.k_cache, batch.v_cache, page_table, seq_lens, qo_indptr,
                batch.max_extend_len, batch.page_size, case.scale, out=out,
            )
        else:
            result = decode_attention(
                q, batch.k_cache, batch.v_cache, page_table, seq_lens, batch.page_size,
                case.scale, num_splits=case.num_splits, out=out, max_seq_len=case.max_seq_len,
            )
        if out is not None and result.data_ptr() != out.data_ptr():
            return "the result is not the out= buffer"
        if result.dtype != dtype or result.shape != batch.q.shape:
            return f"result is {result.dtype} {list(result.shape)}"
        error = max_error(result, reference_attention(batch, case.scale))
        if not error <= TOLERANCE[dtype]:
            return f"max |kernel - reference| = {error} > {TOLERANCE[dtype]}"
    except Exception:
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, "-m", "tests.e2e.model.test_paged_attention_interpreter"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stdout}\n{child.stderr}"
    results: dict[str, str | None] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("case", _CASES, ids=lambda case: case.id)
def test_kernel_matches_reference_in_interpreter(
    interpreted: dict[str, str | None], case: Case
) -> None:
    outcome = interpreted[case.id]
    assert outcome is None, outcome


def test_case_ids_are_unique() -> None:
    assert len({case.id for case in _CASES}) == len(_CASES)


if __name__ == "__main__":
    from hicache.kernels.availability import triton_interpreting

    if not triton_interpreting():
        sys.exit("run with TRITON_INTERPRET=1")
    print(json.dumps({case.id: _run_case(case) for case in _CASES}))
