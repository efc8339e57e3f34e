"""Moving pages between the host pool (L2) and the device pool (L1)."""

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
