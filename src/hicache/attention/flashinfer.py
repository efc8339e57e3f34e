"""The FlashInfer attention backend and its wrapper over flashinfer-python (CUDA, when installed).

FlashInfer is optional (CUDA only, not a dependency): it is imported when a
``FlashInferAttention`` is built. ``kernels.availability.flashinfer_available()``
tells whether it can be.

The device pool is already a paged K/V cache in FlashInfer's "NHD" layout: one
layer's K (or V) is ``[num_slots, kv_heads, D]`` contiguous with slot = page *
page_size + offset, so ``.view(num_pages, page_size, kv_heads, D)`` is
``[max_num_pages, page_size, num_kv_heads, head_dim]`` without a copy
(``paged_cache_view``). FlashInfer describes each sequence's pages in CSR form
rather than as a padded page table; ``paged_kv_layout`` converts one to the other.

FlashInfer splits every step into ``plan`` (once per step: schedules the work
from the lengths, reading them on the host) and ``run`` (once per layer). A
``FlashInferAttention`` keeps that split: ``plan_decode`` / ``plan_extend`` then
``decode`` / ``extend`` per layer. The plan needs the heads and dtype, which a
``FlashInferStep`` learns from the first layer's query, so it plans on the first
``attend`` and every later layer reuses the plan; one ``FlashInferAttention`` (its
workspace and wrappers) serves every step of a backend. ``decode_attention`` /
``extend_attention`` plan and run in one call, with the same semantics as the Triton
entry points (causal, aligned to the end of each sequence's context; GQA; scale
1/sqrt(D) by default). FlashInfer computes in fp16 or bf16 (not fp32).
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from hicache.attention.backend import AttentionBackend, AttentionStep
from hicache.kernels.availability import flashinfer_unavailable_reason

if TYPE_CHECKING:
    from hicache.model.batch import ForwardBatch

# FlashInfer's float workspace: split-KV partial outputs. Its examples use 128 MiB,
# enough for large batches of long contexts; shared by the decode and prefill wrappers
# (their runs never overlap: one stream, one layer at a time).
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
_DTYPES = (torch.float16, torch.bfloat16)


class FlashInferUnavailableError(RuntimeError):
    """FlashInfer cannot run here (not installed, no CUDA device, or its import failed)."""


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        self.kernels = FlashInferAttention(device)

    def prepare(self, batch: ForwardBatch) -> FlashInferStep:
        return FlashInferStep(self.kernels, batch)


class FlashInferStep(AttentionStep):
    def __init__(self, kernels: FlashInferAttention, batch: ForwardBatch) -> None:
        self.kernels = kernels
        self.page_size = batch.page_size
        self.pages = batch.sequence_pages
        self.seq_lens = batch.seq_lens_tensor
        self.decode = batch.num_tokens == batch.num_seqs
        self.qo_indptr = None
        if not self.decode:
            starts = (*batch.token_starts, batch.num_tokens)
            self.qo_indptr = torch.tensor(starts, dtype=torch.int32).to(self.pages.device)
        self.planned = False

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if not self.planned:
            shape = (q.shape[1], k_cache.shape[1], q.shape[2], q.dtype)
            if self.qo_indptr is None:
                self.kernels.plan_decode(self.pages, self.seq_lens, self.page_size, *shape)
            else:
                self.kernels.plan_extend(self.pages, self.seq_lens, self.qo_indptr,
                                         self.page_size, *shape)
            self.planned = True
        if self.qo_indptr is None:
            return self.kernels.decode(q, k_cache, v_cache)
        return self.kernels.extend(q, k_cache, v_cache)


def paged_kv_layout(
    page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page description of a batch: ``(kv_indptr, kv_indices, kv_last_page_len)``.

    ``page_table`` ``[B, max_pages]``: row b holds sequence b's pages in order, then
    anything; ``seq_lens`` ``[B]`` (each >= 1). Returns int32 tensors on the page
    table's device: sequence b's pages are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``
    (ceil(seq_len / page_size) of them) and its last page holds
    ``kv_last_page_len[b]`` tokens, in 1..page_size. Reads the lengths' sum back
    to the host (the size of ``kv_indices``).
    """
    if page_table.dim() != 2 or seq_lens.dim() != 1 or page_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"page_table must be [B, max_pages] and seq_lens [B], got "
            f"{list(page_table.shape)} and {list(seq_lens.shape)}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    lens = seq_lens.to(device=page_table.device, dtype=torch.int64)
    num_pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=page_table.device)
    torch.cumsum(num_pages, dim=0, out=kv_indptr[1:])
    columns = torch.arange(page_table.shape[1], device=page_table.device)
    # Row-major boolean selection keeps each row's pages in order, rows in order.
    kv_indices = page_table[columns[None, :] < num_pages[:, None]].to(torch.int32)
    kv_last_page_len = (lens - (num_pages - 1) * page_size).to(torch.int32)
    return kv_indptr, kv_indices, kv_last_page_len


def paged_cache_view(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """One layer's K or V ``[num_slots, kv_heads, D]`` as ``[num_pages, page_size, kv_heads, D]``.

    The same memory (no copy); raises where the slots are not whole pages or not
    contiguous (a view could not address them).
    """
    num_slots, kv_heads, head_dim = cache.shape
    if num_slots % page_size != 0:
        raise ValueError(f"{num_slots} slots are not whole pages of {page_size}")
    if not cache.is_contiguous():
        raise ValueError("the K/V cache must be contiguous to be viewed as pages")
    return cache.view(num_slots // page_size, page_size, kv_heads, head_dim)


class FlashInferAttention:
    """FlashInfer's decode and prefill wrappers over our pool, planned once per step.

    Per step: ``plan_decode`` (a batch of single-token sequences) or ``plan_extend``
    (any mix), then per layer ``decode`` / ``extend`` with that layer's K/V. A plan
    holds until the next plan of the same kind.
    """

    def __init__(
        self, device: torch.device | str = "cuda", workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._flashinfer = _import_flashinfer(self.device)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Decode wrappers by use_tensor_cores (chosen per plan from the GQA group size).
        self._decode_wrappers: dict[bool, Any] = {}
        self._decode_wrapper: Any = None
        self._prefill_wrapper: Any = None
        self._decode_plan: tuple[int, int, int, int, torch.dtype] | None = None
        self._extend_plan: tuple[int, int, int, int, torch.dtype] | None = None

    def plan_decode(
        self,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> None:
        """Plan ``decode`` for B sequences of one new token each (q ``[B, heads, D]``)."""
        _check_heads(num_heads, num_kv_heads, dtype)
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(
            page_table.to(self.device), seq_lens, page_size
        )
        group = num_heads // num_kv_heads
        # FlashInfer's CUDA-core decode kernels exist for a few group sizes only
        # (1, 2, 3, 4, 8 at least); its tensor-core path (the prefill kernels) takes
        # any, and is the faster one for large groups anyway.
        tensor_cores = group > 4
        wrapper = self._decode_wrappers.get(tensor_cores)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=tensor_cores
            )
            self._decode_wrappers[tensor_cores] = wrapper
        wrapper.plan(
            kv_indptr, kv_indices, last_page_len, num_heads, num_kv_heads, head_dim, page_size,
            q_data_type=dtype, kv_data_type=dtype, sm_scale=_scale(scale, head_dim),
        )
        self._decode_wrapper = wrapper
        self._decode_plan = (seq_lens.shape[0], num_heads, head_dim, page_size, dtype)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the planned decode batch over one layer's K/V: ``[B, heads, D]``."""
        if self._decode_plan is None:
            raise RuntimeError("decode() before plan_decode()")
        batch, num_heads, head_dim, page_size, dtype = self._decode_plan
        _check_run(q, (batch, num_heads, head_dim), dtype, "decode")
        kv = (paged_cache_view(k_cache, page_size), paged_cache_view(v_cache, page_size))
        result: torch.Tensor = self._decode_wrapper.run(q, kv, out=out)
        return result

    def plan_extend(
        self,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: torch.Tensor,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> None:
        """Plan ``extend``: the new tokens of sequence b are q rows ``qo_indptr[b]:[b + 1]``."""
        _check_heads(num_heads, num_kv_heads, dtype)
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(
            page_table.to(self.device), seq_lens, page_size
        )
        if self._prefill_wrapper is None:
            self._prefill_wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD"
            )
        qo_indptr = qo_indptr.to(device=self.device, dtype=torch.int32)
        # causal: FlashInfer aligns the mask to the end of the context (query i of
        # qo_len sees kv positions <= kv_len - qo_len + i), as ours.
        self._prefill_wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len,
            num_heads, num_kv_heads, head_dim, page_size,
            causal=True, sm_scale=_scale(scale, head_dim), q_data_type=dtype, kv_data_type=dtype,
        )
        num_tokens = int(qo_indptr[-1])  # the plan read the lengths on the host already
        self._extend_plan = (num_tokens, num_heads, head_dim, page_size, dtype)

    def extend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the planned extend batch over one layer's K/V: ``[T, heads, D]``."""
        if self._extend_plan is None:
            raise RuntimeError("extend() before plan_extend()")
        num_tokens, num_heads, head_dim, page_size, dtype = self._extend_plan
        _check_run(q, (num_tokens, num_heads, head_dim), dtype, "extend")
        kv = (paged_cache_view(k_cache, page_size), paged_cache_view(v_cache, page_size))
        result: torch.Tensor = self._prefill_wrapper.run(q, kv, out=out)
        return result


_SHARED: dict[torch.device, FlashInferAttention] = {}


def _shared(device: torch.device) -> FlashInferAttention:
    """One FlashInferAttention (one workspace) per device for the one-call entry points."""
    attention = _SHARED.get(device)
    if attention is None:
        attention = _SHARED[device] = FlashInferAttention(device)
    return attention


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Same as ``attention.triton.decode_attention``, planned and run by FlashInfer."""
    attention = _shared(q.device)
    attention.plan_decode(
        page_table, seq_lens, page_size, q.shape[1], k_cache.shape[1], q.shape[2], q.dtype, scale
    )
    return attention.decode(q, k_cache, v_cache)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    page_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Same as ``attention.triton.extend_attention``, planned and run by FlashInfer.

    ``max_extend_len`` is accepted for the same signature; FlashInfer's plan reads
    the lengths itself.
    """
    del max_extend_len
    attention = _shared(q.device)
    attention.plan_extend(
        page_table, seq_lens, qo_indptr, page_size, q.shape[1], k_cache.shape[1], q.shape[2],
        q.dtype, scale,
    )
    return attention.extend(q, k_cache, v_cache)


def _import_flashinfer(device: torch.device) -> ModuleType:
    reason = flashinfer_unavailable_reason(device)
    if reason is not None:
        raise FlashInferUnavailableError(f"FlashInfer attention cannot run: {reason}")
    try:
        return importlib.import_module("flashinfer")
    except ImportError as error:
        raise FlashInferUnavailableError(
            f"FlashInfer attention cannot run: importing flashinfer failed: {error}"
        ) from error


def _check_heads(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    if dtype not in _DTYPES:
        raise ValueError(f"FlashInfer attention takes fp16 or bf16, not {dtype}")


def _check_run(
    q: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype, kind: str
) -> None:
    if tuple(q.shape) != shape or q.dtype != dtype:
        raise ValueError(
            f"q is {list(q.shape)} {q.dtype}, the {kind} plan is for {list(shape)} {dtype}"
        )


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale
