"""Host memory for the L2 pool: pinned to exactly its size, and how much the machine has.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every request up to a power of two: a 40 GB pool pins
64 GiB, and a 70 GB one asks for 128 GiB and fails on a 128 GiB machine. So a
pinned pool is pageable memory that we register with the CUDA driver
(``cudaHostRegister``), byte for byte: portable (every device may copy from it)
and mapped (kernels read it through its address, as the Triton io backend does).
It is unregistered just before the memory is freed: the owner is a numpy array,
which runs its weak-reference callbacks before it releases its data, and every
tensor viewing the pool keeps that array alive.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from hicache.memory.machine_memory import available_memory
from hicache.memory.prefault import pageable

logger = logging.getLogger(__name__)

# Registration covers whole pages anyway; a page-aligned start wastes nothing.
_ALIGN = 4096
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


class HostMemoryError(MemoryError):
    """Host memory could not be allocated or pinned."""


def available_host_memory() -> int | None:
    """Bytes that can be allocated without swapping or hitting a cgroup's limit
    (``machine_memory.available_memory``); None if unknown."""
    available = available_memory()
    return available.bytes if available is not None else None


# What a host pool must leave to the rest of the process and the machine (weights on their
# way to the device, an L3 client's memory segment, Python itself): this much, or a quarter
# of what is available when that is less.
HOST_MEMORY_RESERVE_BYTES = 10 * 2**30


def host_memory_for_pools() -> int | None:
    """Bytes a host KV pool may take: what is available, less a reserve; None if unknown."""
    available = available_host_memory()
    if available is None:
        return None
    return available - min(HOST_MEMORY_RESERVE_BYTES, available // 4)


def empty_host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised 1-D host tensor starting on a memory page; with ``pin``, page-locked
    to exactly its bytes.

    Unpinned pools are page aligned too (torch's allocator only aligns to 64 bytes):
    O_DIRECT file I/O straight into the pool (the nixl L3 backend's ``direct_io``)
    needs block-aligned addresses (``prefault.pageable``: 2 MiB aligned).
    """
    if numel == 0:
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    if not pin:
        return torch.from_numpy(pageable(nbytes)).view(dtype)
    owner = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -owner.ctypes.data % _ALIGN
    window = owner[start : start + nbytes]
    address = int(window.ctypes.data)
    cudart = torch.cuda.cudart()
    flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    code = int(cudart.cudaHostRegister(address, nbytes, flags))
    if code != 0:
        try:
            reason = str(cudart.cudaGetErrorString(cudart.cudaError(code)))
        except Exception:  # only the message is lost
            reason = "unknown"
        raise HostMemoryError(
            f"pinning {nbytes / 1e9:.3f} GB of host memory failed (CUDA error {code}: {reason})"
        )
    # Unpinning gigabytes takes time; at interpreter exit the process goes anyway.
    weakref.finalize(owner, _unregister, address).atexit = False
    flat = torch.from_numpy(window).view(dtype)
    if not flat.is_pinned():  # never seen; PyTorch's own allocator is the safe way out
        logger.warning("registered host memory is not seen as pinned; using torch's allocator")
        del flat, window, owner
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    return flat


def _unregister(address: int) -> None:
    try:
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
    except Exception as error:  # never raise from a finalizer
        logger.warning("unpinning host memory failed: %s", error)
        return
    if code != 0:
        logger.warning("unpinning host memory failed: CUDA error %d", code)
