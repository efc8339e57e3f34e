"""The CPU attention backend and its kernels: every row reads the paged pool in place.

Decode rows (one new token) go to a C++ kernel (``cpu_paged_attention.cpp``), which
walks each context through its page table: nothing is copied, whatever the
contexts' lengths (torch has no CPU attention that reads a paged pool in place, and
gathering every context into a padded tensor per layer per step costs as much as
the attention itself on long contexts). The common head shapes (head sizes 32, 64 and
128, up to 4 query heads a KV head) run code compiled for their shape, where each key
and value row is widened once for its G query heads (SmolLM2's heads, 8 rows over 512
tokens, KV in cache: 0.22 -> 0.16 ms a layer in bf16 and float32; a bf16 decode step of
the model 25 -> 20.5 ms); other shapes take the general loop.

Prompts (cold, or over a cached prefix or earlier chunks) go to the same library's
prefill kernel, all of a step's prompts in one call: causal attention of their new
tokens over their whole context, read from the pool through the page table (the step's
new K/V are already there; no gather). Its layout: a task is one KV head and a block of
up to 128 query positions; its rows (the G query heads sharing that KV head, times the
positions) lie along the vector lanes, so each key and value element loaded is broadcast
against all of them, and scores and outputs are register-blocked products (8 keys x 16
rows; 8 value dimensions x 16 rows) that the compiler turns into AVX-512 FMAs; keys come
in blocks of 128 at absolute positions (each block packed once per task into the score
tile's layout; values read in place), with an online softmax per lane, blocks above the
diagonal skipped and only diagonal ones masked. A query's arithmetic is the same
whichever block, task, thread count or chunk it falls in: a chunked or cached prefill
gives the cold prefill's output bit for bit. bf16/fp16 accumulate in float32; bf16 on a
CPU with AVX512-BF16 multiplies in bf16 (VDPBF16PS: Q.K^T from the bf16 inputs, exact
products; P rounded to bf16 for P.V, as torch's SDPA in bf16 does), elsewhere it and fp16
convert each key and value block to float32 and run the float32 tiles. On a CPU with AMX
(head sizes up to 128) a bf16 prompt's two products per block run on the tile unit
(TDPBF16PS) in the same layouts, transposed so that the online softmax between them is the
vector code's; ``HICACHE_CPU_AMX=0`` keeps them on AVX512-BF16, ``prefill_bf16_path()``
says which path runs. On a 2-vCPU Sapphire Rapids-class VM (SmolLM2's heads, page 16, 2
threads; ``hicache bench attention --dtype bfloat16``): L=1024 9.0-10.4 -> 3.6-3.9 ms a
layer, 256 new tokens after 768 cached 4.0-4.6 -> 1.54 ms, L=2048 34.7-37.7 -> 11.6-12.0 ms.

Measured on this project's CPU machine (2 Zen 4 cores, AVX-512; SmolLM2-135M heads: 9
query, 3 KV, head dim 64; float32, page 16 on shuffled pages, 2 threads; medians of 60
calls (30 at L=2048) alternating with torch's flash SDPA, two runs, load average 1.0-1.1
with another process's light load beside them):
  cold L=256: 1.07-1.31 -> 0.51-0.57 ms (2.1-2.3x); L=1024: 12.1-12.9 -> 6.9-7.0 ms
  (1.76-1.85x; ~175 GFLOP/s counting the causal half, against a ~220 GFLOP/s fp32 FMA
  peak); L=2048: 39.9-43.7 -> 25.8-26.0 ms (1.55-1.68x); 256 new tokens after 768 cached
  (SDPA over the gathered context, as before): 4.56-4.66 -> 2.89-2.91 ms (1.58-1.60x).
  Page size 1: L=1024 1.77x, the 256-token chunk 1.86x.
``hicache bench forward --prompt 1024 --chunk 0`` (alternating, twice): prefill 1,453 and
1,538 -> 1,289 and 1,300 ms, attention 24-25% -> 16% of it; in chunks of 256: 1,522 and
1,479 -> 1,386 and 1,374 ms, attention 21% -> 14-15%.
bf16 with AVX512-BF16 (same machine and shapes, alternating with the conversion to float32,
twice, load average 1.0-1.1): L=256 0.50 -> 0.32 ms (1.56x); L=1024 6.5-6.8 -> 3.9-4.2 ms
(1.61-1.68x; one thread 13.9 -> 8.6 ms); L=2048 25.3-26.0 -> 15.0-15.7 ms (1.65-1.69x); 256
new tokens after 768 cached 2.78 -> 1.63 ms (1.70x); float32 unchanged (1.00x). ``bench
forward`` on SmolLM2-135M in bf16, 1,024 tokens cold: 807 and 859 -> 708 and 782 ms, attention
25% -> 17% of it.
The block sizes come from timing variants (L=256-2048, 1 and 2 threads): 128-key blocks
(64: 1-4% slower), 16-row tiles (32: 2-6% slower, likely from their larger diagonal waste), 8
keys and 8 value dimensions per tile (4: 13% slower; 12 or 16 value dimensions 10-15%
slower). One thread at L=1024 (13.1 ms) splits into scores 42%, weighted values 44%, exp
7%, and 8% the rest (key packing, softmax bookkeeping).

The kernels are compiled at first use (a second or two: they need no torch headers;
``kernels.cpu_build``) and called through ctypes. ``load_cpu_kernel()`` returns None
(and says why in the log, once) where no C++ compiler works: ``auto`` then picks the
``gather`` backend, and a ``CpuPagedBackend`` made directly runs its prompts on SDPA
(a cold prompt over its fresh K/V; one with a context over its gathered K/V).

Measured against the reference (docs/benchmarks.md): decode attention 2.5-3.6x faster
(SmolLM2-135M heads, contexts 512-4096, batches 1-128).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hicache.attention.backend import AttentionBackend, AttentionStep
from hicache.attention.sdpa import SDPA_HAS_GQA, causal_attention
from hicache.kernels.cpu_build import CpuBuildError, LazyLibrary, build_and_load

if TYPE_CHECKING:
    from hicache.model.batch import ForwardBatch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
# Sums may be reassociated (the dot products, the softmax sum, the weighted values: their
# rounding changes by an ulp or so), but infinities and NaNs keep their meaning (no
# -ffinite-math-only): measured 16.0 -> 12.3 ms for a decode step's 30 layers of it
# (SmolLM2, 4 sequences at context 513, one thread), with the vectorized exp.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math", "-shared", "-fPIC", "-std=c++17")
_ABI_VERSION = 3
# "0" keeps bf16 prompts off the AMX tiles on a CPU that has them (AVX512-BF16 instead): to
# compare the two, or where a hypervisor mishandles the tile state.
AMX_ENV = "HICACHE_CPU_AMX"
PREFILL_BF16_PATHS = {0: "float32", 1: "avx512_bf16", 2: "amx"}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class _Prompt:
    """A sequence with several new tokens: rows [start, end) of the step."""

    start: int
    end: int
    slots: torch.Tensor | None  # its whole context's slots; None: cold (no context)
    mask: torch.Tensor | None  # [extend, context] bool: lower-right causal


@dataclass(frozen=True)
class _KernelPrompts:
    """The step's prompts for the prefill kernel: each one's page-table row, its first row
    in the step, its new tokens and its context length (the new tokens included)."""

    pages: torch.Tensor  # [P, pages] int32
    starts: torch.Tensor  # [P] int32
    extends: torch.Tensor  # [P] int32
    totals: torch.Tensor  # [P] int32


@dataclass(frozen=True)
class _Decodes:
    rows: torch.Tensor | None  # their rows in the step; None: every row, in order
    pages: torch.Tensor  # [D, pages] int32: their page-table rows
    lens: torch.Tensor  # [D] int32


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def prepare(self, batch: ForwardBatch) -> CpuPagedStep:
        return CpuPagedStep(batch)


class CpuPagedStep(AttentionStep):
    def __init__(self, batch: ForwardBatch) -> None:
        self.page_size = batch.page_size
        device = batch.page_table.device
        # Prompts go to the kernel where it loads; else to SDPA (a backend made directly,
        # not through make_attention_backend, still runs without a compiler).
        in_kernel = load_cpu_kernel() is not None
        prompts: list[_Prompt] = []
        prompt_seqs: list[int] = []
        decode_seqs: list[int] = []
        for i, (start, extend) in enumerate(zip(batch.token_starts, batch.extend_lens,
                                                 strict=True)):
            total = batch.seq_lens[i]
            if extend == 1:
                decode_seqs.append(i)
            elif in_kernel:
                prompt_seqs.append(i)
            elif extend == total:
                prompts.append(_Prompt(start, start + extend, None, None))
            else:
                pos = torch.arange(total, device=device)
                row = batch.sequence_pages[i].long()
                slots = row[pos // batch.page_size] * batch.page_size + pos % batch.page_size
                mask = pos[None, :] <= pos[total - extend :, None]
                prompts.append(_Prompt(start, start + extend, slots, mask))
        self.prompts = tuple(prompts)
        self.kernel_prompts: _KernelPrompts | None = None
        if prompt_seqs:
            meta = torch.tensor(
                [[batch.token_starts[i], batch.extend_lens[i], batch.seq_lens[i]]
                 for i in prompt_seqs], dtype=torch.int32,
            ).t().contiguous()
            pages = (batch.sequence_pages if len(prompt_seqs) == batch.num_seqs
                     else batch.sequence_pages[torch.tensor(prompt_seqs, device=device)])
            self.kernel_prompts = _KernelPrompts(pages.contiguous(), meta[0], meta[1], meta[2])
        self.decodes: _Decodes | None = None
        if decode_seqs:
            if len(decode_seqs) == batch.num_seqs:
                self.decodes = _Decodes(None, batch.sequence_pages, batch.seq_lens_tensor)
            else:
                index = torch.tensor(decode_seqs, device=device)
                starts = batch.token_starts
                rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
                self.decodes = _Decodes(
                    rows, batch.sequence_pages[index].contiguous(),
                    batch.seq_lens_tensor[index].contiguous(),
                )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        decodes = self.decodes
        if decodes is not None and decodes.rows is None:
            return self._decode(q, k_cache, v_cache, decodes)
        if decodes is None and len(self.prompts) == 1 and self.prompts[0].slots is None:
            return causal_attention(q, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.kernel_prompts is not None:
            kp = self.kernel_prompts
            # Named for torch's profiler (``bench forward --profile`` counts it as attention).
            with torch.profiler.record_function("hicache::attention_cpu_prefill"):
                paged_prefill(q, k_cache, v_cache, kp.pages, kp.starts, kp.extends, kp.totals,
                              self.page_size, out=out)
        for prompt in self.prompts:
            rows = slice(prompt.start, prompt.end)
            if prompt.slots is None:
                out[rows] = causal_attention(q[rows], k[rows], v[rows])
            else:
                assert prompt.mask is not None
                out[rows] = _with_context(q[rows], k_cache, v_cache, prompt.slots, prompt.mask)
        if decodes is not None:
            assert decodes.rows is not None
            out.index_copy_(0, decodes.rows, self._decode(q[decodes.rows], k_cache, v_cache,
                                                          decodes))
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decodes: _Decodes
    ) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, decodes.pages, decodes.lens, self.page_size)


def _with_context(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    # [L, kv_heads, D] -> [1, kv_heads, L, D]; SDPA's enable_gqa maps query heads onto
    # their KV head without copying K/V once per query head.
    # index_select, not k_cache[slots]: the same rows, 5x faster for these shapes (it copies
    # whole rows where advanced indexing goes element by element).
    k_ctx = k_cache.index_select(0, slots).transpose(0, 1)[None]
    v_ctx = v_cache.index_select(0, slots).transpose(0, 1)[None]
    groups = q.shape[1] // k_cache.shape[1]
    if groups > 1 and not SDPA_HAS_GQA:
        k_ctx, v_ctx = k_ctx.repeat_interleave(groups, 1), v_ctx.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_ctx, v_ctx, attn_mask=mask,
        **({"enable_gqa": True} if groups > 1 and SDPA_HAS_GQA else {}),
    )
    return out[0].transpose(0, 1)


# ------------------------------------------------------------------ the kernel
class CpuKernelError(RuntimeError):
    """The CPU kernel was called with tensors it does not take."""


def _unavailable(error: Exception) -> None:
    logger.warning(
        "CPU paged attention kernel unavailable (%s): decode attention gathers each context "
        "instead, prompts run on SDPA", error,
    )


def cpu_kernel_unavailable_reason() -> str | None:
    """None when the kernel is (or can be) loaded; else why not."""
    load_cpu_kernel()
    return _LIBRARY.reason


def load_cpu_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be."""
    return _LIBRARY.get()


def _load() -> ctypes.CDLL:
    try:
        library = build_and_load(_SOURCE, _FLAGS)
    except CpuBuildError as error:
        raise CpuKernelError(str(error)) from error
    if library.hicache_kernel_abi_version() != _ABI_VERSION:
        raise CpuKernelError(f"{library._name} has another ABI version")
    fn = library.hicache_paged_decode
    fn.restype = ctypes.c_int
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [
        i32, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr,
        i32, i32, i32, i32, i32, ctypes.c_float, i32,
    ]
    fn = library.hicache_paged_prefill
    fn.restype = ctypes.c_int
    fn.argtypes = [
        i32, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
        i32, i32, i32, i32, i32, ctypes.c_float, i32,
    ]
    library.hicache_prefill_bf16_path.restype = ctypes.c_int
    library.hicache_prefill_bf16_path.argtypes = []
    library.hicache_set_prefill_amx.restype = ctypes.c_int
    library.hicache_set_prefill_amx.argtypes = [i32]
    if os.environ.get(AMX_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        library.hicache_set_prefill_amx(0)
    return library


def prefill_bf16_path() -> str | None:
    """How the prefill kernel multiplies a bf16 prompt here ("amx", "avx512_bf16" or
    "float32"); None without the kernel."""
    library = load_cpu_kernel()
    if library is None:
        return None
    return PREFILL_BF16_PATHS[library.hicache_prefill_bf16_path()]


def set_prefill_amx(enabled: bool) -> bool:
    """Lets bf16 prompts use the AMX tiles (where the CPU has them) or not; returns the
    previous setting (False where there are none)."""
    library = load_cpu_kernel()
    if library is None:
        return False
    return bool(library.hicache_set_prefill_amx(int(enabled)))


_LIBRARY = LazyLibrary(_load, (OSError, subprocess.SubprocessError, CpuKernelError), _unavailable)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [B, heads, D] of one query per sequence over its paged context.

    q: [B, heads, D]; k_cache, v_cache: [slots, kv_heads, D] (one layer of the pool);
    page_table: int32 [B, >= pages of the longest context]; seq_lens: int32 [B], each >= 1.
    The last dimension of q and the caches must be contiguous.
    """
    library = load_cpu_kernel()
    if library is None:
        raise CpuKernelError(f"the CPU kernel is unavailable: {_LIBRARY.reason}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    _check(q, k_cache, v_cache, page_table)
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise CpuKernelError("seq_lens must be contiguous int32")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    status = library.hicache_paged_decode(
        _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, page_size,
        scale if scale is not None else head_dim**-0.5, torch.get_num_threads(),
    )
    if status != 0:
        raise CpuKernelError(f"the CPU kernel failed with status {status}")
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    starts: torch.Tensor,
    extends: torch.Tensor,
    totals: torch.Tensor,
    page_size: int,
    out: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of prompts' new tokens over their whole paged contexts, into ``out``.

    Prompt b's new tokens are rows [starts[b], starts[b] + extends[b]) of q (and of out), at
    positions [totals[b] - extends[b], totals[b]); its keys and values, positions
    [0, totals[b]), lie in k_cache, v_cache [slots, kv_heads, D] (one layer of the pool)
    through page_table row b (int32 [P, >= its pages]). starts, extends, totals: int32 [P],
    each extend >= 1. q: [T, heads, D]; out: [T, heads, D] (made when None; rows of no
    prompt are left as they are). The last dimension of q, out and the caches must be
    contiguous.
    """
    library = load_cpu_kernel()
    if library is None:
        raise CpuKernelError(f"the CPU kernel is unavailable: {_LIBRARY.reason}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    _check(q, k_cache, v_cache, page_table)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise CpuKernelError("out must match q, its head dimension contiguous")
    meta = (starts, extends, totals)
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in meta):
        raise CpuKernelError("starts, extends and totals must be contiguous int32")
    num_prompts = starts.shape[0]
    if num_prompts == 0:
        return out
    status = library.hicache_paged_prefill(
        _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        page_table.data_ptr(), page_table.stride(0), starts.data_ptr(), extends.data_ptr(),
        totals.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        num_prompts, num_heads, num_kv_heads, head_dim, page_size,
        scale if scale is not None else head_dim**-0.5, torch.get_num_threads(),
    )
    if status != 0:
        raise CpuKernelError(f"the CPU kernel failed with status {status}")
    return out


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor
) -> None:
    """What both kernels need of their tensors; CpuKernelError if not."""
    if _DTYPE_CODES.get(q.dtype) is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise CpuKernelError(f"dtypes {q.dtype}/{k_cache.dtype} are not supported")
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise CpuKernelError("the CPU kernel takes CPU tensors")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise CpuKernelError("the head dimension must be contiguous")
    if k_cache.stride() != v_cache.stride() or q.shape[1] % k_cache.shape[1]:
        raise CpuKernelError("k and v caches must match, and kv heads divide heads")
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
        raise CpuKernelError("page_table must be int32, its rows contiguous")
