"""Uninitialized, frozen parameters: the model is built empty, then filled by a loader.

Building with ``torch.empty`` on the target device (no random init, no CPU copy)
is what lets an 8B model load straight onto the GPU one checkpoint tensor at a
time, needing its own size in memory and not twice that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# HF parameter name -> a view of (part of) one of our parameters: loading copies a
# checkpoint tensor into the view; fused projections expose one view per HF tensor.
WeightViews = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightShard:
    """Where one checkpoint tensor goes: ``target``, a view of (part of) one of our
    parameters, receives the checkpoint tensor (of ``full_shape``) whole when ``dim``
    is None, else its part ``[start, start + target.shape[dim])`` along ``dim`` (the
    rank's slice under tensor parallelism)."""

    target: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0

    def index(self) -> tuple[slice, ...]:
        """The part as an index into the checkpoint tensor (safetensors' ``get_slice``)."""
        if self.dim is None:
            return (slice(None),)
        stop = self.start + self.target.shape[self.dim]
        return (*(slice(None),) * self.dim, slice(self.start, stop))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The part of the checkpoint tensor ``full`` this shard receives."""
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.target.shape[self.dim])


# HF parameter name -> where that checkpoint tensor (or the rank's part of it) goes.
WeightShards = dict[str, WeightShard]


def whole(target: torch.Tensor) -> WeightShard:
    """A checkpoint tensor held whole (every rank's copy, or TP=1)."""
    return WeightShard(target, tuple(target.shape))


def part(target: torch.Tensor, full_shape: tuple[int, ...], dim: int, start: int) -> WeightShard:
    """``target`` holds the part of a checkpoint tensor of ``full_shape`` from ``start``
    along ``dim`` (all of it when the shapes agree)."""
    if tuple(target.shape) == full_shape:
        return whole(target)
    return WeightShard(target, full_shape, dim, start)


def empty_parameter(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)
