"""GPU kernels the model runs: paged attention reading K/V in place in the device pool.

Each backend imports its GPU library (Triton, FlashInfer) only when a kernel is
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
