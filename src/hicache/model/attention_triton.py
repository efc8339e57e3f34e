"""The Triton attention backend: decode and extend read K/V in place through the page table.

A batch of decodes runs the decode kernel (split over long contexts and merged);
a batch of cold prefills (no context in the pool yet) attends each prompt's own
fresh K/V with torch's causal SDPA (the flash kernel on GPU, as a plain prefill:
the extend kernel trailed it on long prompts); any other mix runs the extend
kernel, which takes decode rows too. Nothing reads a length back from the
device, so a step never waits for the GPU to plan.
Triton's CPU interpreter runs the same kernels on CPU tensors (``TRITON_INTERPRET=1``),
which is how the tests check this backend without a GPU.
"""

from __future__ import annotations

import torch

from hicache.kernels.paged_attention_triton import decode_attention, extend_attention
from hicache.model.attention_backend import AttentionBackend, AttentionStep
from hicache.model.attention_gather import causal_attention
from hicache.model.batch import ForwardBatch


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
