"""Limit a benchmarked server to a few CPU cores (``--cpus N`` of ``hicache bench compare``).

Two things together, because neither is enough alone:

- the server's command runs under ``taskset -c LIST``: the kernel schedules it and
  every process it spawns (worker processes, a shell's children) only on those CPUs;
- thread-count variables (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ...) are set to
  N in its environment: a math library that sizes its thread pool from the machine's
  core count rather than the affinity mask would otherwise start more threads than
  cores and have them fight over the N cores. ``VLLM_CPU_OMP_THREADS_BIND`` names
  the same CPUs, as vLLM's CPU build binds its OpenMP threads to the cores it lists
  there (by default to the cores of a whole NUMA node, outside the mask).

The CPUs are the first N this process may run on. The benchmark client is moved
to the others, when there are any, for the duration of the runs, so its own work
does not share the servers' cores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

# Variables that size the thread pools of OpenMP, BLAS libraries and PyTorch's own.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


class CpuLimitError(ValueError):
    """The limit cannot be applied here (too many CPUs asked for, no taskset)."""


def available_cpus() -> list[int]:
    """The CPUs this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class CpuLimit:
    """Run servers on ``cpus`` only (see the module's documentation)."""

    cpus: tuple[int, ...]

    @classmethod
    def first(cls, count: int) -> CpuLimit:
        """The first ``count`` CPUs this process may run on."""
        cpus = available_cpus()
        if count < 1:
            raise CpuLimitError(f"--cpus must be >= 1, got {count}")
        if count > len(cpus):
            raise CpuLimitError(
                f"--cpus {count}: this process may only run on {len(cpus)} CPUs ({cpus})"
            )
        if shutil.which("taskset") is None:
            raise CpuLimitError("--cpus needs the taskset program (util-linux)")
        return cls(tuple(cpus[:count]))

    @property
    def cpu_list(self) -> str:
        return ",".join(str(c) for c in self.cpus)

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` run under ``taskset`` on these CPUs."""
        return ["taskset", "-c", self.cpu_list, *command]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the thread counts set."""
        env = dict(os.environ if base is None else base)
        count = str(len(self.cpus))
        env.update(dict.fromkeys(THREAD_VARIABLES, count))
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_list
        return env

    def describe(self) -> str:
        return (
            f"servers pinned to CPU(s) {self.cpu_list} (taskset -c {self.cpu_list}; "
            f"{', '.join(THREAD_VARIABLES)}={len(self.cpus)}; "
            f"VLLM_CPU_OMP_THREADS_BIND={self.cpu_list})"
        )

    @contextlib.contextmanager
    def client_elsewhere(self) -> Iterator[list[int] | None]:
        """Move this process (the benchmark client) off the servers' CPUs while the block
        runs, when other CPUs are left; yields the client's CPUs (None: left as it was)."""
        before = os.sched_getaffinity(0)
        rest = sorted(before - set(self.cpus))
        if not rest:
            yield None
            return
        os.sched_setaffinity(0, rest)
        try:
            yield rest
        finally:
            os.sched_setaffinity(0, before)
