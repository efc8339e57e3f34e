"""Shape of the KV cache of one model rank: layers, KV heads, head dim, dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.config import ConfigError

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KVGeometry:
    """KV geometry of one tensor-parallel rank (MHA or GQA: K and V per layer)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGeometry.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"KV dtype {self.dtype} is not supported; use fp32, fp16 or bf16")

    @property
    def row_elems(self) -> int:
        """Elements of one token's K (or V) in one layer: kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.row_elems * self.element_bytes

    def page_bytes(self, page_size: int) -> int:
        return self.bytes_per_token * page_size

    def describe(self) -> str:
        """Stable text used to namespace page keys (see radix.keys)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{dtype}"


# Realistic geometries for benchmarks and demos (per rank, TP=1).
LLAMA3_8B = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
QWEN3_0_6B = KVGeometry(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
TINY = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
