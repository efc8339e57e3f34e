"""torch's intra-op CPU threads for the engine: the default, and applying it.

A CPU forward splits its matrix products over torch's intra-op pool (OpenMP,
and MKL's own). On a machine whose cores are also busy with other work (the
HTTP server's event loop, tokenization, another process) a pool as wide as the
machine loses more than it gains: OpenMP workers wait for the slowest of them
at every barrier, and a worker whose core was taken stalls them all. So the
default leaves one core to the rest of the process on small machines
(``default_num_threads``), and the engine takes that core too while nothing else
keeps it busy (``adaptive_range`` and ``engine.thread_governor``);
``--num-threads`` fixes the count, and so does OMP_NUM_THREADS when set (torch
has already read it at import).

``torch.set_num_threads`` is process-wide and each thread takes the count in
force when it first runs a parallel op: ``apply_num_threads`` is called when an
engine is built, and the scheduler thread sets it again on itself when it starts.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as containers limit it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(cores: int | None = None) -> int:
    """Intra-op threads when not told: one core left for the rest of the process."""
    cores = available_cores() if cores is None else cores
    return max(1, cores - 1)


def resolve_num_threads(num_threads: int | None) -> int:
    """The count in force: as given; else OMP_NUM_THREADS' (torch's own); else the default."""
    if num_threads is not None:
        return num_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return default_num_threads()


def adaptive_range(num_threads: int | None, device_type: str) -> tuple[int, int] | None:
    """(low, high) for a ThreadGovernor when the count is left to the engine on a CPU of
    two or more cores: one fewer than the cores while other work keeps them busy, all of
    them while it does not; None when the count is fixed (given, OMP_NUM_THREADS, a GPU,
    one core)."""
    if num_threads is not None or os.environ.get("OMP_NUM_THREADS") or device_type != "cpu":
        return None
    cores = available_cores()
    if cores < 2:
        return None
    return default_num_threads(cores), cores


def set_thread_count(num_threads: int) -> None:
    """For this thread and every thread that has not run a parallel torch op yet."""
    torch.set_num_threads(num_threads)


def apply_num_threads(num_threads: int | None) -> int:
    """Resolve and set the process-wide count; returns it."""
    resolved = resolve_num_threads(num_threads)
    set_thread_count(resolved)
    return resolved
