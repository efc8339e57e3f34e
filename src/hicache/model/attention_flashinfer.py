"""The FlashInfer attention backend (CUDA, when ``flashinfer-python`` is installed).

FlashInfer plans each step on the host (its work partition over the pages) and
then runs once per layer; the plan needs the heads and dtype, which the step
learns from the first layer's query, so it is made on the first ``attend`` and
reused by every later layer. One ``FlashInferAttention`` (its workspace and
wrappers) serves every step.
"""

from __future__ import annotations

import torch

from hicache.kernels.flashinfer_attention import FlashInferAttention
from hicache.model.attention_backend import AttentionBackend, AttentionStep
from hicache.model.batch import ForwardBatch


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
