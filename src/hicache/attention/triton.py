"""The Triton attention backend and its launchers: decode and extend read K/V in place.

The backend: a batch of decodes runs the decode kernel (split over long contexts and
merged); a batch of cold prefills (no context in the pool yet) attends each prompt's
own fresh K/V with torch's causal SDPA (the flash kernel on GPU, as a plain prefill:
the extend kernel trailed it on long prompts); any other mix runs the extend kernel,
which takes decode rows too. Triton's CPU interpreter runs the same kernels on CPU
tensors (``TRITON_INTERPRET=1``), which is how the tests check this backend without
a GPU.

What both kernel entry points (``decode_attention``, ``extend_attention``) get, for
one forward step (shared by every layer):

- ``k_cache``, ``v_cache``: one layer of the device pool, ``[num_slots, kv_heads, D]``,
  slot = page * page_size + offset in the page (``DevicePool.k_buffer(layer)``). The
  step's new K/V must already be written there: every key is read from the pool.
- ``page_table``: int ``[B, max_pages]``, row b = sequence b's pages in order;
  entries past its pages are never read.
- ``seq_lens``: int ``[B]``, context length of each sequence after this step.
- ``q``: the new tokens' queries; query head h reads KV head ``h // (heads // kv_heads)``.

Attention is causal and aligned to the end of the context: new token i of a
sequence with ``extend_len`` new tokens sits at position ``seq_len - extend_len + i``
and attends the keys at positions up to its own. Scores, softmax and the output
accumulate in fp32; the output has q's dtype.

Nothing here reads a length back to the host: grids are sized from shapes and
from the caller's host-side bounds (``max_extend_len``, ``max_seq_len``), so neither
a step's plan nor a launch waits for the GPU.

Triton is imported when a kernel is first called (``triton_jit``), so this module
imports where Triton is missing. Under the Triton interpreter (``TRITON_INTERPRET=1``,
set before that first call) CPU tensors are accepted.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from hicache.attention.backend import AttentionBackend, AttentionStep
from hicache.attention.sdpa import causal_attention
from hicache.kernels.availability import triton_interpreting, triton_unavailable_reason

if TYPE_CHECKING:
    from hicache.model.batch import ForwardBatch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

# Split-K decode (flash-decoding): with few sequences, (sequence, KV head) programs
# alone leave most SMs idle, so long contexts are cut into splits attended in
# parallel and merged by a second pass. A split is never shorter than this many
# keys, as short splits make the merge pass the larger cost (a starting value, not
# yet tuned on a GPU, like the block sizes below) ...
_MIN_SPLIT_KEYS = 256
# ... and there are at most this many (the merge pass holds them all in one tile).
_MAX_SPLITS = 64
# Programs to aim for per SM: a couple of waves hide the tail of uneven lengths.
_PROGRAMS_PER_SM = 2


class AttentionKernelUnavailableError(RuntimeError):
    """The Triton attention kernels cannot run here (no Triton, or tensors it cannot reach)."""


class TritonBackend(AttentionBackend):
    name = "triton"
    # Decode: lengths from the device tensor, max(seq_lens) only sizes the key splits
    # (the last split of a sequence runs to its true end).
    reads_device_lengths = True

    def prepare(self, batch: ForwardBatch) -> TritonStep:
        return TritonStep(batch)


class TritonStep(AttentionStep):
    def __init__(self, batch: ForwardBatch) -> None:
        self.page_size = batch.page_size
        self.pages = batch.sequence_pages
        self.seq_lens = batch.seq_lens_tensor
        self.max_seq_len = max(batch.seq_lens)
        self.all_decode = batch.num_tokens == batch.num_seqs
        self.max_extend = max(batch.extend_lens)
        self.qo_indptr = None
        # Every sequence a prompt with nothing in the pool before it: [start, end) rows.
        self.cold_rows: list[tuple[int, int]] | None = None
        cold = all(e == s for e, s in zip(batch.extend_lens, batch.seq_lens, strict=True))
        if cold and not self.all_decode:
            ends = (*batch.token_starts[1:], batch.num_tokens)
            self.cold_rows = list(zip(batch.token_starts, ends, strict=True))
        elif not self.all_decode:
            starts = (*batch.token_starts, batch.num_tokens)
            self.qo_indptr = torch.tensor(starts, dtype=torch.int32).to(self.pages.device)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if self.cold_rows is not None:
            if len(self.cold_rows) == 1:
                return causal_attention(q, k, v)
            out = torch.empty_like(q)
            for start, end in self.cold_rows:
                out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
            return out
        if self.qo_indptr is None:
            return decode_attention(q, k_cache, v_cache, self.pages, self.seq_lens,
                                    self.page_size, max_seq_len=self.max_seq_len)
        return extend_attention(q, k_cache, v_cache, self.pages, self.seq_lens, self.qo_indptr,
                                self.max_extend, self.page_size)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence: q ``[B, heads, D]`` -> ``[B, heads, D]``.

    Token b sits at position ``seq_lens[b] - 1`` and attends all ``seq_lens[b]`` keys
    of its context (``seq_lens[b] >= 1``).

    ``max_seq_len``: a host-side bound on ``seq_lens`` (default: the page table's
    width in tokens); it only sizes the splits, and a longer sequence is still
    attended in full (by its last split). ``num_splits``: force the number of key
    splits (default: chosen from the batch, the bound and the GPU's SM count; 1 on
    the interpreter). ``out``: an output tensor to write into instead of a new one.
    """
    _check_common(q, k_cache, v_cache, page_table, seq_lens, page_size)
    batch, num_heads, head_dim = q.shape
    if page_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"page_table has {page_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} "
            f"lengths for {batch} sequences"
        )
    out = _output(q, out)
    if batch == 0:
        return out
    page_table, seq_lens = _rows_contiguous(page_table), seq_lens.contiguous()
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    bound = page_table.shape[1] * page_size if max_seq_len is None else max_seq_len
    bound = max(1, min(bound, page_table.shape[1] * page_size))
    if num_splits is None:
        num_splits = _auto_splits(batch * num_kv_heads, bound, q.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")
    block_n = _block_n(head_dim, k_cache.element_size())
    # Split length rounded up to whole key blocks, so no block straddles two splits.
    split_len = -(-bound // (num_splits * block_n)) * block_n
    num_splits = -(-bound // split_len)  # after rounding, fewer splits may cover the bound
    block_d = _block_d(head_dim)
    direct = num_splits == 1
    kernels = _kernels(q.device)
    if direct:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    with _on_device(q.device):
        kernels.decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, page_table, seq_lens, out, part_out, part_lse,
            _scale_log2(scale, head_dim), split_len, num_heads, num_splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
            out.stride(0), out.stride(1),
            PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_H=max(16, _next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
            DIRECT=direct, DOT_MODE=_dot_mode(kernels, q.dtype),
            num_warps=4, num_stages=2,
        )
        if not direct:
            kernels.decode_reduce_kernel[(batch, num_heads)](
                part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


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
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of any mix of sequences: q ``[T, heads, D]`` -> ``[T, heads, D]``.

    The new tokens of sequence b are rows ``qo_indptr[b]:qo_indptr[b + 1]`` of q
    (at least one each); a sequence may have a cached prefix or none (cold
    prefill), and one new token (decode) is a valid extend. ``max_extend_len``: a
    host-side bound on the new tokens of any sequence (it sizes the grid; a
    smaller value than the real maximum leaves rows unwritten). ``out``: an output
    tensor to write into instead of a new one.
    """
    _check_common(q, k_cache, v_cache, page_table, seq_lens, page_size)
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] != batch + 1:
        raise ValueError(f"qo_indptr must be [{batch + 1}], got {list(qo_indptr.shape)}")
    if qo_indptr.dtype not in _INDEX_DTYPES or qo_indptr.device != q.device:
        raise ValueError(f"qo_indptr must be int32/int64 on {q.device}")
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for {batch} sequences")
    out = _output(q, out)
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return out
    page_table, seq_lens = _rows_contiguous(page_table), seq_lens.contiguous()
    qo_indptr = qo_indptr.contiguous()
    kernels = _kernels(q.device)
    group = num_heads // k_cache.shape[1]
    block_m = 64
    block_n = _block_n(head_dim, k_cache.element_size())
    grid = (batch, num_heads, -(-max_extend_len // block_m))
    with _on_device(q.device):
        kernels.extend_kernel[grid](
            q, k_cache, v_cache, page_table, seq_lens, qo_indptr, out,
            _scale_log2(scale, head_dim),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
            out.stride(0), out.stride(1),
            PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim),
            DOT_MODE=_dot_mode(kernels, q.dtype),
            num_warps=4 if head_dim <= 64 else 8, num_stages=2,
        )
    return out


def _check_common(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """Shape, dtype and device checks that read nothing back from the device."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q must be [tokens, heads, D] and k/v caches [slots, kv_heads, D], got "
            f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the caches {k_cache.shape[2]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one of fp16/bf16/fp32, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if page_size < 1 or k_cache.shape[0] % page_size != 0:
        raise ValueError(f"{k_cache.shape[0]} slots are not whole pages of {page_size}")
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"head_dim must be in 1..256, got {head_dim}")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if page_table.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    for name, tensor in (("page_table", page_table), ("seq_lens", seq_lens)):
        if tensor.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    for tensor in (k_cache, v_cache, page_table, seq_lens):
        if tensor.device != q.device:
            raise ValueError(f"all tensors must be on {q.device}, one is on {tensor.device}")


def _rows_contiguous(page_table: torch.Tensor) -> torch.Tensor:
    # The kernels step along a row by 1; rows may be any stride apart (a slice of
    # a wider persistent table is fine as it is).
    return page_table if page_table.stride(1) == 1 else page_table.contiguous()


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be like q: {list(q.shape)} {q.dtype} on {q.device}")
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in head_dim")
    return out


def _kernels(device: torch.device) -> ModuleType:
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise AttentionKernelUnavailableError(f"Triton attention cannot run: {reason}")
    try:
        return importlib.import_module("hicache.attention.triton_jit")
    except ImportError as error:  # a broken Triton install
        raise AttentionKernelUnavailableError(
            f"Triton attention cannot run: importing Triton failed: {error}"
        ) from error


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _auto_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Key splits per (sequence, KV head): enough programs to fill the GPU, none too short."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after the other
    wanted = -(-_PROGRAMS_PER_SM * _sm_count(device.index) // programs)
    longest = -(-max_keys // _MIN_SPLIT_KEYS)
    return max(1, min(wanted, longest, _MAX_SPLITS))


@functools.cache
def _sm_count(index: int | None) -> int:
    return int(torch.cuda.get_device_properties(index or 0).multi_processor_count)


def _scale_log2(scale: float | None, head_dim: int) -> float:
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    return scale * math.log2(math.e)  # the kernels exponentiate in base 2


def _dot_mode(kernels: ModuleType, dtype: torch.dtype) -> int:
    """How the kernels multiply (see triton_jit's docstring)."""
    if dtype == torch.float32:
        return int(kernels.DOT_IEEE)  # exact products: tf32 would keep 10 mantissa bits
    if dtype == torch.bfloat16 and triton_interpreting():
        return int(kernels.DOT_UPCAST)  # the interpreter's tl.dot cannot multiply bf16
    return int(kernels.DOT_NATIVE)


def _block_d(head_dim: int) -> int:
    return max(16, _next_power_of_2(head_dim))  # tl.dot needs tiles of 16 or more


def _block_n(head_dim: int, element_bytes: int) -> int:
    # Keys per block: 64, halved where a key row is wide (D=256 in half precision,
    # D >= 128 in fp32), keeping K and V tiles of two pipeline stages in shared memory.
    return 32 if _block_d(head_dim) * element_bytes > 256 else 64


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
