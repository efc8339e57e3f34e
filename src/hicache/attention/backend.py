"""Attention backends: how a step's queries attend to their contexts in the paged pool.

A backend turns a ``ForwardBatch`` into an ``AttentionStep`` once per forward step
(everything that depends only on the batch's lengths and page table: masks,
index tensors, kernel plans), and every layer then calls ``step.attend`` with
its own q/k/v and its layer of the pool. Every layer has written the step's new
K/V into the pool before it attends, so a backend reads all keys from there.

Backends (``make_attention_backend``):
- ``gather``: the reference; gathers each context out of the pool, then SDPA.
- ``cpu``: decode and prompts read the pages in place (C++ kernels built at first
  use).
- ``triton``: Triton kernels reading pages in place (CUDA).
- ``flashinfer``: FlashInfer's paged kernels (CUDA, when installed).
``auto`` picks per device, fastest first among those that load here.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from hicache.config import ConfigError

if TYPE_CHECKING:
    from hicache.model.batch import ForwardBatch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "gather", "cpu", "triton", "flashinfer")


class AttentionStep(ABC):
    """One forward step's attention, shared by every layer."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Output [T, heads, head_dim] of the step's new tokens.

        q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], the new tokens' (already
        written to the pool); k_cache, v_cache: one layer of the pool [slots, kv_heads, D].
        """


class AttentionBackend(ABC):
    name: str
    # Does a decode step read the sequences' lengths from ``batch.seq_lens_tensor``
    # alone, taking the host-side ``seq_lens`` only as bounds? Then a decode step can
    # be captured once and replayed for any lengths (``engine.decode_graphs``).
    reads_device_lengths: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> AttentionStep:
        """The step's attention, from the batch's lengths and page table."""


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend ``name`` for ``device``; ``auto``: the fastest that works there.

    A named backend that cannot run on ``device`` is a ConfigError; ``auto`` never
    fails (``gather`` runs everywhere).
    """
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "auto":
        for candidate in _preference(device):
            if _unavailable(candidate, device) is None:
                return _build(candidate, device)
        return _build("gather", device)
    reason = _unavailable(name, device)
    if reason is not None:
        raise ConfigError(f"attention backend {name!r} cannot run on {device}: {reason}")
    return _build(name, device)


def _preference(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("flashinfer", "triton", "gather")
    if device.type == "cpu":
        return ("cpu", "gather")
    return ("gather",)


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``; None if it can."""
    if name == "gather":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return "it runs on the CPU only"
        from hicache.attention.cpu import cpu_kernel_unavailable_reason

        return cpu_kernel_unavailable_reason()
    from hicache.kernels.availability import (
        flashinfer_unavailable_reason,
        triton_unavailable_reason,
    )

    if name == "triton":
        # On CPU tensors only under Triton's interpreter (tests).
        return triton_unavailable_reason(device)
    if name == "flashinfer":
        return flashinfer_unavailable_reason(device)
    return "unknown backend"


def _build(name: str, device: torch.device) -> AttentionBackend:
    if name == "cpu":
        from hicache.attention.cpu import CpuPagedBackend

        return CpuPagedBackend()
    if name == "triton":
        from hicache.attention.triton import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from hicache.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    from hicache.attention.gather import GatherBackend

    return GatherBackend()
