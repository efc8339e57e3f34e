"""torch's intra-op threads chosen step by step from how busy the machine's other work is.

On a small CPU machine the best thread count for the forward depends on what
else runs. Measured on 2 cores (SmolLM2-135M, multi-turn workload, engine in its
own process; docs/benchmarks.md): with the machine otherwise idle, 2 threads gave
1.13x the throughput of 1; with two other processes spinning, 2 threads fell to
0.74x of 1 (OpenMP's workers wait at every barrier for the one whose core was
taken) while 1 thread lost only 14%. So when not told (``--num-threads``), the
engine uses every core it may run on while the others' work leaves them free,
and one fewer when it does not.

Every ``interval_s`` the governor reads how much CPU time the cores this process
may use spent busy (``/proc/stat``, per CPU) and subtracts this process's own
(``os.times``): the rest is other work. Above ``busy_above`` cores of it the
count drops to ``low``; below ``idle_below`` it rises to ``high`` (the gap keeps
it from flapping). It runs on the scheduler thread between steps (a few
microseconds, one file read a second); ``torch.set_num_threads`` there applies to
that thread's next parallel region.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# A step of fewer rows than this runs on ``low`` threads whatever the machine: one row (a
# single request decoding) streams the weights once, which one core already does at the
# memory's pace (SmolLM2, 2 cores: 21.0 ms a step on 1 thread, 21.1 ms on 2), so a second
# thread only adds barriers that wait whenever the server or a client takes its core
# (serving one client measured 0.79x of vLLM's tokens/s that way, 0.94x on one thread).
MIN_ROWS_FOR_ALL = 2
# Cores of other work: above this the forward takes one core fewer, below the other
# threshold all of them again.
BUSY_ABOVE_CORES = 0.6
IDLE_BELOW_CORES = 0.3
INTERVAL_S = 1.0
_PROC_STAT = Path("/proc/stat")


def busy_seconds(cpus: Iterable[int], stat_text: str | None = None) -> float | None:
    """CPU seconds the given CPUs have spent busy since boot (None where /proc/stat is not)."""
    try:
        text = stat_text if stat_text is not None else _PROC_STAT.read_text()
    except OSError:
        return None
    wanted = {f"cpu{cpu}" for cpu in cpus}
    ticks = 0
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [int(v) for v in fields[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            ticks += sum(values[:8]) - idle  # user .. steal; guest is inside user
    return ticks / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds this process (every thread) has used."""
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    def __init__(
        self, low: int, high: int, cpus: Iterable[int] | None = None,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        machine_busy: Callable[[], float | None] | None = None,
        own_busy: Callable[[], float] = own_seconds,
    ) -> None:
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
        self.low, self.high = low, high
        cpu_list = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self._machine_busy = machine_busy or (lambda: busy_seconds(cpu_list))
        self._own_busy = own_busy
        self._clock = clock
        self.interval_s = interval_s
        self.threads = high  # until the first reading says otherwise
        self.others_cores = 0.0  # the last reading of the other work, in cores
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._machine_busy(), self._own_busy()

    def threads_for(self, rows: int) -> int:
        """The count for a step of ``rows`` new tokens."""
        return self.threads if rows >= MIN_ROWS_FOR_ALL else self.low

    def tick(self) -> int | None:
        """The new thread count when it should change now, else None."""
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return None
        sample = self._sample()
        (then, machine_then, own_then), self._last = self._last, sample
        _, machine_now, own_now = sample
        if machine_then is None or machine_now is None or sample[0] <= then:
            return None
        others = (machine_now - machine_then - (own_now - own_then)) / (sample[0] - then)
        self.others_cores = max(0.0, others)
        wanted = self.threads
        if self.others_cores > BUSY_ABOVE_CORES:
            wanted = self.low
        elif self.others_cores < IDLE_BELOW_CORES:
            wanted = self.high
        if wanted == self.threads:
            return None
        self.threads = wanted
        return wanted
