"""Kernels the model runs outside torch: paged attention reading K/V in place in the pool.

On the CPU, a C++ decode kernel built at first use (``cpu_attention``); on CUDA, Triton
kernels and a FlashInfer wrapper, each importing its library only when a kernel is
called, so this package imports everywhere; ``triton_available`` and
``flashinfer_available`` say, without importing either library, whether one can run.
"""

from hicache.kernels.availability import (
    flashinfer_available,
    flashinfer_unavailable_reason,
    triton_available,
    triton_installed,
    triton_interpreting,
    triton_unavailable_reason,
)

__all__ = [
    "flashinfer_available",
    "flashinfer_unavailable_reason",
    "triton_available",
    "triton_installed",
    "triton_interpreting",
    "triton_unavailable_reason",
]
