"""The io backend contract: move whole pages between the host pool and the device pool.

Both directions take page ids as int64 CPU tensors of equal length; entry i of
the source list is copied to entry i of the destination list. ``layer`` selects
one layer (for layer-wise loading overlapped with compute) or, when None, all
layers.

Ordering contract: on CUDA, work is enqueued on the *current* CUDA stream and
the call returns without waiting (the caller owns streams and events); the
host pages must stay untouched until the caller has observed completion. On
CPU the copy has completed when the call returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool


class TransferError(RuntimeError):
    """A transfer request that cannot be carried out (mismatched pools or page lists)."""


class IOBackend(ABC):
    """Moves pages between one host pool and one device pool."""

    name: str = "abstract"

    def __init__(self, host: HostPool, device: DevicePool) -> None:
        if host.geometry != device.geometry or host.page_size != device.page_size:
            raise TransferError(
                f"host pool ({host.geometry.describe()}, page {host.page_size}) and device pool "
                f"({device.geometry.describe()}, page {device.page_size}) do not match"
            )
        self.host = host
        self.device = device

    @abstractmethod
    def load(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        """Copy host pages into device pages (L2 -> L1)."""

    @abstractmethod
    def store(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        """Copy device pages into host pages (L1 -> L2)."""

    def _check(self, src: torch.Tensor, dst: torch.Tensor, layer: int | None) -> None:
        if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
            raise TransferError(
                f"page lists must be 1-D and equally long, got {tuple(src.shape)} and "
                f"{tuple(dst.shape)}"
            )
        if src.dtype != torch.int64 or dst.dtype != torch.int64:
            raise TransferError("page lists must be int64")
        if layer is not None and not 0 <= layer < self.host.geometry.num_layers:
            raise TransferError(
                f"layer {layer} out of range [0, {self.host.geometry.num_layers})"
            )
