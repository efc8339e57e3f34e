"""TPGroup: the collectives a tensor-parallel model needs, over torch.distributed.

One process per rank; the ranks of one model form the torch.distributed world,
joined by ``init_tp_group`` (gloo on the CPU, NCCL on CUDA). A group of size 1 has
no process group at all and every collective returns its input untouched: a
single-rank model pays nothing for being written tensor-parallel.

Every rank must call the same collectives in the same order (they block until
all ranks have); the model does, since every rank runs the same layers. Beside the
model's sum, last-dim gather and object broadcast, the group offers the minimum and
the object gathers that the replicated schedulers and the start-up agreement use
(always on gloo for the schedulers' own collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hicache.config import ConfigError

T = TypeVar("T")

# How long a collective waits for the other ranks before failing (not hanging).
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TPGroup:
    """This process's rank in a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1
    # The ranks' process group; None exactly when size is 1.
    group: dist.ProcessGroup | None = None
    # Where Python objects travel: a gloo group (the same as ``group`` on the CPU), so
    # broadcasting a batch's description never goes through the GPU.
    cpu_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tp rank {self.rank} is outside [0, {self.size})")
        if (self.group is None) != (self.size == 1):
            raise ConfigError("a TPGroup has a process group exactly when its size is above 1")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same values."""
        if self.group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_min(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum over the ranks of a CPU ``tensor``, in place.

        It runs on the gloo group (``cpu_group``): the schedulers' agreements are host
        integers, never worth a trip to the GPU.
        """
        if self.cpu_group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return tensor

    def all_gather_last_dim(
        self, tensor: torch.Tensor, widths: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The ranks' tensors concatenated along the last dim, in rank order.

        ``widths``: every rank's last-dim size, when they differ (an uneven split);
        None: all equal this rank's. Other dims must agree across ranks.
        """
        if self.group is None:
            return tensor
        width = tensor.shape[-1]
        widths = widths if widths is not None else (width,) * self.size
        if len(widths) != self.size or widths[self.rank] != width:
            raise ValueError(f"rank {self.rank} has width {width}, widths say {widths}")
        # The collective moves equal shapes: pad to the widest, cut the padding off after.
        widest = max(widths)
        part = F.pad(tensor, (0, widest - width)) if width < widest else tensor.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` is ignored elsewhere."""
        if self.group is None:
            return obj
        box: list[Any] = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        result: T = box[0]
        return result

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank ``dst``; None elsewhere."""
        if self.group is None:
            return [obj]
        box: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, box, dst=dst, group=self.cpu_group)
        return box

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.group is None:
            return [obj]
        box: list[Any] = [None] * self.size
        dist.all_gather_object(box, obj, group=self.cpu_group)
        return box

    def barrier(self) -> None:
        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Leave the group (the process's torch.distributed world); size 1: nothing."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()


SINGLE_RANK = TPGroup()


def default_backend(device: torch.device | str) -> str:
    """NCCL between CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tp_group(
    rank: int,
    size: int,
    init_method: str,
    backend: str | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join rank ``rank`` of ``size`` at ``init_method`` (e.g. ``tcp://127.0.0.1:PORT``).

    ``backend`` None picks by ``device`` (``default_backend``); on CUDA the process's
    current device becomes ``device`` (``cuda`` alone: ``cuda:<rank>``). Size 1 joins
    nothing and returns ``SINGLE_RANK``. The ranks form this process's torch.distributed
    world, so a process is in at most one group; a rank that waits more than
    ``timeout_s`` for the others fails instead of hanging.
    """
    if size == 1 and rank == 0:
        return SINGLE_RANK
    if not 0 <= rank < size:
        raise ConfigError(f"tp rank {rank} is outside [0, {size})")
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a torch.distributed group")
    device = torch.device(device)
    backend = backend or default_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else rank)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    group = dist.group.WORLD
    assert group is not None
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, group, cpu_group)
