"""Device (L1) KV pool: paged, layer_first, what the attention kernels read."""

from __future__ import annotations

import torch

from hicache.config import ConfigError, MemLayout
from hicache.memory.allocator import PageAllocator
from hicache.memory.geometry import KVGeometry
from hicache.memory.layout import PageStrides, canonical_view, page_strides


class DevicePool:
    """KV of ``num_pages`` pages on ``device``.

    Storage: one flat buffer viewed as ``kv[layers, kv_planes, num_slots, kv_heads, head_dim]``
    where slot = page * page_size + offset-in-page. MHA/GQA attention reads
    ``k_buffer(layer)`` / ``v_buffer(layer)``: ``[num_slots, kv_heads, head_dim]``;
    MLA attention reads ``latent_buffer(layer)``: ``[num_slots, 1, latent_dim]``.
    """

    layout = MemLayout.LAYER_FIRST

    def __init__(
        self, geometry: KVGeometry, num_pages: int, page_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_slots = num_pages * page_size
        planes = geometry.kv_planes
        numel = geometry.num_layers * planes * self.num_slots * geometry.row_elems
        self.flat = torch.zeros(numel, dtype=geometry.dtype, device=self.device)
        # kv: [layers, planes, num_slots, kv_heads, head_dim]
        self.kv = self.flat.view(
            geometry.num_layers, planes, self.num_slots, geometry.num_kv_heads, geometry.head_dim
        )
        self.strides: PageStrides = page_strides(self.layout, geometry, num_pages, page_size)
        # pages: [num_pages, layers, planes, page_size, row]
        self.pages = canonical_view(self.flat, self.strides, geometry, num_pages, page_size)
        self.allocator = PageAllocator(num_pages, name="device pool")

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes(self.page_size)

    @property
    def size_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Plane 0 of ``layer``: K, or for MLA the latent. [num_slots, kv_heads, head_dim]"""
        return self.kv[layer, 0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V of ``layer``: [num_slots, kv_heads, head_dim]. MLA caches no V."""
        if self.geometry.is_mla:
            raise ConfigError(
                "an MLA KV pool caches one latent per token and no separate V: read "
                "latent_buffer(layer) and project V out of it"
            )
        return self.kv[layer, 1]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """The MLA latent of ``layer``: [num_slots, 1, latent_dim] (MLA pools only)."""
        if not self.geometry.is_mla:
            raise ConfigError(
                f"latent_buffer is for MLA pools; this pool caches K and V "
                f"({self.geometry.describe()}): read k_buffer / v_buffer"
            )
        return self.kv[layer, 0]

    def slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Token slots of ``pages`` in order: [len(pages) * page_size] int64."""
        offsets = torch.arange(self.page_size, device=pages.device, dtype=torch.int64)
        return (pages.to(torch.int64)[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
