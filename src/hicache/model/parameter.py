"""Uninitialized, frozen parameters: the model is built empty, then filled by a loader.

Building with ``torch.empty`` on the target device (no random init, no CPU copy)
is what lets an 8B model load straight onto the GPU one checkpoint tensor at a
time, needing its own size in memory and not twice that.
"""

from __future__ import annotations

import torch
from torch import nn

# HF parameter name -> a view of (part of) one of our parameters: loading copies a
# checkpoint tensor into the view; fused projections expose one view per HF tensor.
WeightViews = dict[str, torch.Tensor]


def empty_parameter(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)
