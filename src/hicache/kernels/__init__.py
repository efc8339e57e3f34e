"""Native code outside torch that more than one package shares, and optional GPU libraries.

``cpu_build`` compiles a C++ source once per machine and loads it through ctypes (the
CPU attention kernel of ``hicache.attention.cpu`` and ``cpu_layer_ops``, the forward's
one-pass float32 RMSNorm and RoPE). ``availability`` says, without importing either
library, whether Triton (attention and page-copy kernels) and FlashInfer can run here.
The attention kernels themselves live with their backends in ``hicache.attention``.
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
