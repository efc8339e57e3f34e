"""YaRN rotary frequencies (DeepSeek-V2/V3's long-context RoPE scaling).

Dimensions that rotate many times within the original context keep their speed
(extrapolation), those that rotate less than once are slowed by ``factor``
(interpolation), and a linear ramp over dimension index blends the band between;
``beta_fast`` / ``beta_slow`` are the rotation counts bounding the ramp. The
tables are also scaled (``YarnRopeScaling.attention_factor``, in ``rotary``).
"""

from __future__ import annotations

import math

import torch

from hicache.model.deepseek_config import YarnRopeScaling


def yarn_inv_freq(rope_dim: int, theta: float, s: YarnRopeScaling) -> torch.Tensor:
    """[rope_dim / 2] float32 rotation speeds, fastest first."""
    # float32 throughout, as the checkpoints' reference computes them.
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    extrapolated = 1.0 / theta**exponents
    interpolated = extrapolated / s.factor
    low = _dim_of_rotations(s.beta_fast, rope_dim, theta, s.original_max_position_embeddings)
    high = _dim_of_rotations(s.beta_slow, rope_dim, theta, s.original_max_position_embeddings)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the speed), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def _dim_of_rotations(rotations: float, rope_dim: int, theta: float, context: int) -> float:
    """The (fractional) dimension index whose wavelength fits ``rotations`` times in ``context``."""
    return (rope_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))
