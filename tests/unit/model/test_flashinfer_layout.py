"""FlashInfer's page description of a batch, the pool viewed as its pages, and the wrapper's glue.

FlashInfer itself runs on CUDA only (tests/gpu/test_paged_attention_gpu.py). Here,
on the CPU: the conversion of (page_table, seq_lens, page_size) into (kv_indptr,
kv_indices, kv_last_page_len), the no-copy page view of a pool layer, and
``FlashInferAttention`` driving a stand-in ``flashinfer`` module that computes
attention the way FlashInfer's documentation defines it, from the CSR page
description and the 4-D page view only: so the arguments the wrapper hands over
are checked against the reference, not against the stand-in's own assumptions
about our page table.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from typing import Any

import pytest
import torch

from hicache.attention import flashinfer as flashinfer_attention
from hicache.attention.flashinfer import (
    FlashInferAttention,
    FlashInferUnavailableError,
    paged_cache_view,
    paged_kv_layout,
)
from hicache.kernels.availability import flashinfer_available
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from tests.attention_reference import TOLERANCE, make_batch, max_error, reference_attention


def test_layout_of_a_small_batch() -> None:
    # Page size 4: 5 tokens = 2 pages (1 in the last), 4 = 1 full page, 1 = 1 page.
    page_table = torch.tensor([[7, 2, 99], [3, 99, 99], [9, 5, 99]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 4, 1], dtype=torch.int32)
    kv_indptr, kv_indices, last = paged_kv_layout(page_table, seq_lens, 4)
    assert kv_indptr.tolist() == [0, 2, 3, 4]
    assert kv_indices.tolist() == [7, 2, 3, 9]
    assert last.tolist() == [1, 4, 1]
    assert {t.dtype for t in (kv_indptr, kv_indices, last)} == {torch.int32}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_layout_addresses_the_same_slots_as_the_page_table(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    seq_lens = torch.randint(1, 70, (9,), generator=gen)
    width = int((seq_lens.max() + page_size - 1) // page_size) + 3
    page_table = torch.randint(0, 1000, (9, width), generator=gen, dtype=torch.int32)
    kv_indptr, kv_indices, last = paged_kv_layout(page_table, seq_lens.int(), page_size)
    for b, length in enumerate(seq_lens.tolist()):
        positions = torch.arange(length)
        from_table = page_table[b, positions // page_size].long() * page_size
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        assert 1 <= int(last[b]) <= page_size
        assert (len(pages) - 1) * page_size + int(last[b]) == length
        from_layout = pages[positions // page_size] * page_size
        assert torch.equal(from_table + positions % page_size, from_layout + positions % page_size)


def test_page_view_is_the_pool_layer_without_a_copy() -> None:
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    pool = DevicePool(geometry, num_pages=5, page_size=4)
    pool.flat.copy_(torch.randn(pool.flat.numel()).half())
    k = pool.k_buffer(2)
    pages = paged_cache_view(k, 4)
    assert pages.shape == (5, 4, 2, 8)
    assert pages.data_ptr() == k.data_ptr()
    for slot in (0, 3, 4, 13, 19):
        assert torch.equal(pages[slot // 4, slot % 4], k[slot])


def test_page_view_refuses_partial_pages() -> None:
    with pytest.raises(ValueError, match="whole pages"):
        paged_cache_view(torch.zeros(10, 2, 8), 4)


@pytest.mark.skipif(flashinfer_available(), reason="FlashInfer is usable here")
def test_without_flashinfer_building_the_wrapper_says_why() -> None:
    with pytest.raises(FlashInferUnavailableError, match="FlashInfer attention cannot run"):
        FlashInferAttention("cpu")


# ---- FlashInferAttention driving a stand-in for the flashinfer module ----------------


def _documented_attention(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: dict[str, Any]
) -> torch.Tensor:
    """Paged attention as FlashInfer documents it: CSR pages of [pages, page_size, kv_heads, D]."""
    k_pages, v_pages = kv
    page_size = k_pages.shape[1]
    assert page_size == plan["page_size"]
    assert k_pages.shape[2:] == (plan["num_kv_heads"], plan["head_dim"])
    group = plan["num_qo_heads"] // plan["num_kv_heads"]
    indptr, indices, last = plan["indptr"], plan["indices"], plan["last_page_len"]
    qo_indptr = plan["qo_indptr"]
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(len(last)):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        keys = k_pages[pages].flatten(0, 1)  # [pages * page_size, kv_heads, D]
        values = v_pages[pages].flatten(0, 1)
        kv_len = (len(pages) - 1) * page_size + int(last[b])
        keys, values = keys[:kv_len].float(), values[:kv_len].float()
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        qo_len = rows.stop - rows.start
        scores = torch.einsum(
            "thd,lhd->htl", q[rows].float(), keys.repeat_interleave(group, dim=1)
        ) * plan["sm_scale"]
        if plan["causal"]:  # aligned to the bottom right: query i sees kv <= kv_len - qo_len + i
            visible = torch.arange(kv_len)[None, :] <= (kv_len - qo_len + torch.arange(qo_len))[
                :, None
            ]
            scores = scores.masked_fill(~visible[None], float("-inf"))
        out[rows] = torch.einsum(
            "htl,lhd->thd", scores.softmax(-1), values.repeat_interleave(group, dim=1)
        ).to(q.dtype)
    return out


class _StandInWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str, **options: Any) -> None:
        assert kv_layout == "NHD"
        self.options = options
        self.plan_args: dict[str, Any] | None = None

    def run(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], out: Any = None
    ) -> torch.Tensor:
        assert self.plan_args is not None, "run before plan"
        assert q.dtype == self.plan_args["q_data_type"] == kv[0].dtype
        return _documented_attention(q, kv, self.plan_args)


class _StandInDecode(_StandInWrapper):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             **kwargs: Any) -> None:
        batch = len(last_page_len)
        self.plan_args = dict(
            indptr=indptr, indices=indices, last_page_len=last_page_len,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            page_size=page_size, qo_indptr=torch.arange(batch + 1), causal=False,
            sm_scale=kwargs.pop("sm_scale", None) or 1 / math.sqrt(head_dim), **kwargs,
        )


class _StandInPrefill(_StandInWrapper):
    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, causal: bool = False, **kwargs: Any) -> None:
        self.plan_args = dict(
            indptr=indptr, indices=indices, last_page_len=last_page_len,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            page_size=page_size, qo_indptr=qo_indptr, causal=causal,
            sm_scale=kwargs.pop("sm_scale", None) or 1 / math.sqrt(head_dim), **kwargs,
        )


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.BatchDecodeWithPagedKVCacheWrapper = _StandInDecode  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = _StandInPrefill  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    # The stand-in runs on the CPU, which the real availability check refuses.
    monkeypatch.setattr(flashinfer_attention, "flashinfer_unavailable_reason", lambda device: None)
    monkeypatch.setattr(flashinfer_attention, "_SHARED", {})
    return module


@pytest.mark.parametrize(
    ("heads", "kv_heads", "page_size", "scale"), [(4, 4, 16, None), (9, 3, 1, 0.3), (8, 1, 4, None)]
)
def test_wrapper_extend_plans_what_the_reference_computes(
    stand_in: types.ModuleType, heads: int, kv_heads: int, page_size: int, scale: float | None
) -> None:
    batch = make_batch(
        [37, 1, 50, 20], [5, 1, 50, 1], heads=heads, kv_heads=kv_heads, head_dim=16,
        page_size=page_size, dtype=torch.float16, seed=page_size,
    )
    attention = FlashInferAttention("cpu", workspace_bytes=16)
    attention.plan_extend(
        batch.page_table, batch.seq_lens, batch.qo_indptr, page_size, heads, kv_heads, 16,
        torch.float16, scale,
    )
    out = attention.extend(batch.q, batch.k_cache, batch.v_cache)
    assert max_error(out, reference_attention(batch, scale)) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize(("heads", "kv_heads", "tensor_cores"), [(4, 2, False), (8, 1, True)])
def test_wrapper_decode_plans_what_the_reference_computes(
    stand_in: types.ModuleType, heads: int, kv_heads: int, tensor_cores: bool
) -> None:
    batch = make_batch(
        [1, 16, 17, 70], [1, 1, 1, 1], heads=heads, kv_heads=kv_heads, head_dim=16,
        page_size=16, dtype=torch.bfloat16, seed=heads,
    )
    out = flashinfer_attention.decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 16
    )
    assert max_error(out, reference_attention(batch)) <= TOLERANCE[torch.bfloat16]
    shared = flashinfer_attention._SHARED[torch.device("cpu")]
    assert shared._decode_wrapper.options == {"use_tensor_cores": tensor_cores}


def test_wrapper_refuses_a_q_unlike_its_plan(stand_in: types.ModuleType) -> None:
    batch = make_batch(
        [10, 5], [1, 1], heads=4, kv_heads=2, head_dim=16, page_size=4,
        dtype=torch.float16, seed=0,
    )
    attention = FlashInferAttention("cpu", workspace_bytes=16)
    with pytest.raises(RuntimeError, match="before plan_decode"):
        attention.decode(batch.q, batch.k_cache, batch.v_cache)
    attention.plan_decode(batch.page_table, batch.seq_lens, 4, 4, 2, 16, torch.float16)
    with pytest.raises(ValueError, match="the decode plan is for"):
        attention.decode(batch.q[:1], batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        attention.plan_decode(batch.page_table, batch.seq_lens, 4, 4, 2, 16, torch.float32)
