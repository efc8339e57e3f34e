"""Moving pages between the host pool (L2) and the device pool (L1): the io backends.

- ``base``: the contract (``IOBackend``: whole pages, one layer or all, in either
  direction; on CUDA enqueued on the current stream, on the CPU done when it returns);
- ``direct``: torch copies only (between CPU pools one per page where a page's part is
  large, batched below; through a staging buffer with CUDA);
- ``kernel`` (``triton_kernels``): one Triton gather/scatter that reads and writes
  pinned host memory from the GPU;
- ``digesting``: with a CPU device, copies a piece at a time that checksum each host
  page while it is in the CPU cache (writes record the checksum for L3; loads verify
  pages read from L3).

``create_io_backend`` picks one; ``kernel`` falls back to ``direct`` where it cannot run.
"""

from __future__ import annotations

import logging

from hicache.config import IOBackendKind
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import IOBackend, TransferError
from hicache.transfer.direct import DirectBackend

__all__ = ["DirectBackend", "IOBackend", "TransferError", "create_io_backend"]

logger = logging.getLogger(__name__)


def create_io_backend(kind: IOBackendKind | str, host: HostPool, device: DevicePool) -> IOBackend:
    """The io backend ``kind`` for these pools.

    "kernel" falls back to "direct", with one warning saying why, where it cannot
    run: device pool not on CUDA, host pool not pinned, or Triton missing.
    """
    try:
        kind = IOBackendKind(kind)
    except ValueError:
        choices = ", ".join(member.value for member in IOBackendKind)
        raise TransferError(f"unknown io backend {kind!r}; choose one of: {choices}") from None
    if kind is IOBackendKind.DIRECT:
        return DirectBackend(host, device)
    # Imported here so that hicache.transfer never pulls in Triton by itself.
    from hicache.transfer.kernel import (
        KernelBackend,
        KernelUnavailableError,
        kernel_unavailable_reason,
    )

    reason = kernel_unavailable_reason(host, device)
    if reason is None:
        try:
            return KernelBackend(host, device)
        except KernelUnavailableError as error:
            reason = str(error)
    logger.warning("io backend 'kernel' is unavailable (%s); falling back to 'direct'", reason)
    return DirectBackend(host, device)
