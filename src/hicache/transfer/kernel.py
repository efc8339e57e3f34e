"""KernelBackend: one Triton kernel gathers/scatters pages, reading pinned host memory directly.

No staging and no DMA engine: GPU threads load from (or store to) the pinned
host pool over PCIe and write (read) the device pool, one program per
(page, layer, plane: K, V or MLA latent). Any mix of host layout, direction, page order and layer
selection is one launch. Triton is imported only when a KernelBackend is built,
so this module imports on CPU-only machines without Triton.

Under the Triton interpreter (``TRITON_INTERPRET=1``) CPU pools are accepted, so
the kernel itself can be tested without a GPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from hicache.kernels.availability import triton_installed, triton_interpreting
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.memory.layout import PageStrides
from hicache.transfer.base import IOBackend, TransferError
from hicache.transfer.direct import check_page_ids

# triton_interpreting moved to hicache.kernels.availability; still importable from here.
__all__ = [
    "KernelBackend", "KernelUnavailableError", "kernel_unavailable_reason", "triton_interpreting",
]

_UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class KernelUnavailableError(TransferError):
    """The kernel backend cannot run here (no CUDA, unpinned host pool, or no Triton)."""


def kernel_unavailable_reason(host: HostPool, device: DevicePool) -> str | None:
    """Why KernelBackend cannot serve these pools, or None when it can."""
    if device.device.type == "cuda":
        if not host.flat.is_pinned():
            return "the host pool is not pinned, so the GPU cannot address it"
    elif not triton_interpreting():
        return f"the device pool is on {device.device}, not on a CUDA device"
    if not triton_installed():
        return "Triton is not installed"
    return None


def _copy_unit(elem_bytes: int, row_elems: int, *buffers: tuple[torch.Tensor, PageStrides]) -> int:
    """Widest copy unit (bytes, <= 8) dividing the row, every stride and buffer size/address."""
    sizes = [row_elems * elem_bytes]
    for flat, strides in buffers:
        sizes += [flat.numel() * elem_bytes, flat.data_ptr()]
        sizes += [s * elem_bytes for s in (strides.page, strides.layer, strides.kv, strides.token)]
    for unit in (8, 4, 2, 1):
        if unit >= elem_bytes and all(size % unit == 0 for size in sizes):
            return unit
    return elem_bytes  # unreachable: every size is a multiple of elem_bytes


class KernelBackend(IOBackend):
    """Triton gather/scatter between a pinned host pool and a CUDA device pool."""

    name = "kernel"

    def __init__(
        self, host: HostPool, device: DevicePool, *, token_major: bool | None = None
    ) -> None:
        super().__init__(host, device)
        reason = kernel_unavailable_reason(host, device)
        if reason is not None:
            raise KernelUnavailableError(
                f"io backend 'kernel' cannot run: {reason}; use io backend 'direct'"
            )
        try:
            self._kernels: ModuleType = importlib.import_module("hicache.transfer.triton_kernels")
        except ImportError as error:  # a broken Triton install
            raise KernelUnavailableError(
                f"io backend 'kernel' cannot run: importing Triton failed: {error}"
            ) from error
        geometry = host.geometry
        elem = geometry.element_bytes
        unit = _copy_unit(
            elem, geometry.row_elems, (host.flat, host.strides), (device.flat, device.strides)
        )
        scale = unit // elem  # elements per unit
        dtype = _UNIT_DTYPES[unit]
        # Flat views in units: the kernel copies bits, never interprets them.
        self._host_units = host.flat.view(dtype)
        self._device_units = device.flat.view(dtype)
        self._host_strides = _in_units(host.strides, scale)
        self._device_strides = _in_units(device.strides, scale)
        self._row_units = geometry.row_elems // scale
        # Walk pages in the host layout's memory order, so every tile is contiguous
        # host memory: token-major where a token's layers are adjacent (page_first).
        if token_major is None:
            token_major = host.strides.token > host.strides.layer
        self.token_major = token_major
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile every kernel variant this backend launches, now rather than mid-request.

        Triton compiles a variant on its first launch; left to then, the first
        write-back or L2 hit of a server would stall for a second or more. Empty page
        lists select the same variants as real ones (the page count is only the grid)
        and launch nothing (Triton skips an empty grid), so no page is touched.
        A variant that fails to compile makes the backend unavailable here and now.
        """
        empty = torch.empty(0, dtype=torch.int64, device=self.device.device)
        host = (self._host_units, self._host_strides)
        device = (self._device_units, self._device_strides)
        try:
            for (src, src_strides), (dst, dst_strides) in ((host, device), (device, host)):
                for first, count in ((0, self.host.geometry.num_layers), (0, 1)):
                    self._copy(src, src_strides, dst, dst_strides, empty, empty, first, count)
        except Exception as error:  # Triton's compile errors have no common base class
            raise KernelUnavailableError(
                f"io backend 'kernel' cannot run: compiling its copy kernel failed: {error}"
            ) from error

    def load(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        self._check(host_pages, device_pages, layer)
        check_page_ids(host_pages, self.host.num_pages, "host")
        check_page_ids(device_pages, self.device.num_pages, "device")
        self._launch(
            self._host_units, self._host_strides, self._device_units, self._device_strides,
            host_pages, device_pages, layer,
        )

    def store(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        self._check(device_pages, host_pages, layer)
        check_page_ids(device_pages, self.device.num_pages, "device")
        check_page_ids(host_pages, self.host.num_pages, "host")
        self._launch(
            self._device_units, self._device_strides, self._host_units, self._host_strides,
            device_pages, host_pages, layer,
        )

    def _launch(
        self,
        src: torch.Tensor,
        src_strides: tuple[int, int, int, int],
        dst: torch.Tensor,
        dst_strides: tuple[int, int, int, int],
        src_pages: torch.Tensor,
        dst_pages: torch.Tensor,
        layer: int | None,
    ) -> None:
        if src_pages.numel() == 0:
            return
        target = self.device.device
        # The kernel reads the page lists on the device; a pageable H2D copy is
        # stream-ordered and safe to drop after the call (caching allocator).
        src_idx = src_pages.to(target, non_blocking=True)
        dst_idx = dst_pages.to(target, non_blocking=True)
        first, count = (0, self.host.geometry.num_layers) if layer is None else (layer, 1)
        self._copy(src, src_strides, dst, dst_strides, src_idx, dst_idx, first, count)

    def _copy(
        self,
        src: torch.Tensor,
        src_strides: tuple[int, int, int, int],
        dst: torch.Tensor,
        dst_strides: tuple[int, int, int, int],
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        first: int,
        count: int,
    ) -> None:
        target = self.device.device
        args = (
            src, src_strides, dst, dst_strides, src_idx, dst_idx, first, count,
            self.host.page_size, self._row_units, self.token_major, self.host.geometry.kv_planes,
        )
        if target.type == "cuda":
            # Triton launches on the current device's current stream.
            with torch.cuda.device(target):
                self._kernels.copy_pages(*args)
        else:
            self._kernels.copy_pages(*args)


def _in_units(strides: PageStrides, scale: int) -> tuple[int, int, int, int]:
    return (
        strides.page // scale, strides.layer // scale, strides.kv // scale, strides.token // scale
    )
