"""Shape of the KV cache of one model rank: layers, KV planes, KV heads, head dim, dtype.

A plane is one tensor cached per token per layer: MHA/GQA caches two (K and V),
MLA (DeepSeek-V2/V3) one (the compressed latent, kv_lora_rank + qk_rope_head_dim
elements, shared by every head and identical on every tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.config import ConfigError

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KVGeometry:
    """KV geometry of one tensor-parallel rank.

    ``kv_planes`` is 2 for MHA/GQA (K and V per layer) and 1 for MLA (one latent
    per layer: build it with ``KVGeometry.mla``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kv_planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGeometry.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"KV dtype {self.dtype} is not supported; use fp32, fp16 or bf16")
        if self.kv_planes not in (1, 2):
            raise ConfigError(
                "KVGeometry.kv_planes must be 2 (K and V) or 1 (MLA latent), "
                f"got {self.kv_planes!r}"
            )
        if self.kv_planes == 1 and self.num_kv_heads != 1:
            raise ConfigError(
                "an MLA geometry (kv_planes=1) caches one latent per token: num_kv_heads must be "
                f"1, got {self.num_kv_heads}"
            )

    @classmethod
    def mla(
        cls, num_layers: int, latent_dim: int, dtype: torch.dtype = torch.bfloat16
    ) -> KVGeometry:
        """MLA: one latent of ``latent_dim`` (kv_lora_rank + qk_rope_head_dim) per token, layer."""
        return cls(num_layers, num_kv_heads=1, head_dim=latent_dim, dtype=dtype, kv_planes=1)

    @property
    def is_mla(self) -> bool:
        return self.kv_planes == 1

    @property
    def row_elems(self) -> int:
        """Elements of one plane's row (one token's K, V or latent in one layer)."""
        return self.num_kv_heads * self.head_dim

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Every plane (K and V, or the latent) of one token across all layers."""
        return self.num_layers * self.kv_planes * self.row_elems * self.element_bytes

    def page_bytes(self, page_size: int) -> int:
        return self.bytes_per_token * page_size

    def describe(self) -> str:
        """Stable text used to namespace page keys (see radix.keys).

        The MHA text predates MLA and must not change (L3 pages already written
        under it stay readable); MLA's own prefix keeps the two from ever sharing keys.
        """
        dtype = str(self.dtype).removeprefix("torch.")
        if self.is_mla:
            return f"MLA-L{self.num_layers}-D{self.head_dim}-{dtype}"
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{dtype}"


# Realistic geometries for benchmarks and demos (per rank, TP=1).
LLAMA3_8B = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
QWEN3_0_6B = KVGeometry(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
TINY = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
# DeepSeek-V2-Lite: 27 layers, latent kv_lora_rank 512 + qk_rope_head_dim 64.
DEEPSEEK_V2_LITE = KVGeometry.mla(num_layers=27, latent_dim=576, dtype=torch.bfloat16)
TINY_MLA = KVGeometry.mla(num_layers=4, latent_dim=24, dtype=torch.float32)

# Geometries by the name benchmarks take (``--geometry``).
GEOMETRY_PRESETS: dict[str, KVGeometry] = {
    "llama3-8b": LLAMA3_8B,
    "qwen3-0.6b": QWEN3_0_6B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
}
