"""Rotary position embedding (RoPE), with Llama-3.1's and YaRN's frequency scaling.

Convention: "rotate half", as in the Hugging Face checkpoints: dimension i of
a head is paired with dimension i + head_dim / 2, and the pair is rotated by
``position * inv_freq[i]``. DeepSeek pairs neighbours instead (2i with 2i + 1:
``apply_rotary_interleaved``). cos/sin are precomputed for every position up to
``max_position_embeddings`` once, so a forward step only gathers rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hicache.kernels import cpu_layer_ops
from hicache.model.config import Llama3RopeScaling
from hicache.model.deepseek_config import YarnRopeScaling
from hicache.model.yarn import yarn_inv_freq


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | YarnRopeScaling | None = None
) -> torch.Tensor:
    """Rotation speed of each dimension pair: [head_dim / 2] float32, fastest first."""
    if isinstance(scaling, YarnRopeScaling):
        return yarn_inv_freq(head_dim, theta, scaling)
    # float32 on purpose: the checkpoints were trained with frequencies and angles
    # computed in float32, and matching them beats being more exact.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Slow down low frequencies for long contexts, keep high ones, blend in between.

    A dimension whose wavelength fits many times in the original context
    (``context / wavelength > high_freq_factor``) carries local position and is
    kept; one that barely fits (``< low_freq_factor``) is slowed by ``factor`` so
    it keeps working ``factor`` times further; the band between interpolates
    linearly in ``context / wavelength``.
    """
    wavelength = 2 * math.pi / inv_freq
    fits = s.original_max_position_embeddings / wavelength
    keep = ((fits - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - keep) * inv_freq / s.factor + keep * inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables ([max_positions, head_dim / 2], model dtype) and their application."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Llama3RopeScaling | YarnRopeScaling | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        # YaRN scales cos and sin themselves (so the rotary part of q.k by its square).
        gain = scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0
        # Rounded to the model dtype, as the q/k they multiply: the products then round
        # exactly as the reference models' do.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (angles.cos() * gain).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * gain).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [T]: each [T, 1, head_dim / 2] (broadcast over heads)."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by the angles whose cos/sin are [T, 1, head_dim / 2]."""
    fused = cpu_layer_ops.rotary(x, cos, sin)  # float32 on the CPU: one pass, same values
    if fused is not None:
        return fused
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """DeepSeek's RoPE: rotate the pairs (x[2i], x[2i + 1]) of ``x`` [..., rope_dim].

    The result is laid out de-interleaved ([rotated evens | rotated odds]), as
    transformers' DeepseekV3 returns it. q and k get the same layout, so their dot
    product equals the interleaved one (transformers' DeepseekV2 keeps pairs in place):
    the cached rotary keys are in this layout, and only this code reads them.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
