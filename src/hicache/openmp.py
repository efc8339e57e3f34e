"""OpenMP threads of torch's CPU ops, per thread.

The engine's helper threads (the L2 copies, the L3 calls) run torch ops beside the
forward, whose OpenMP team takes every core the engine was given. See
``one_openmp_thread_here``.
"""

from __future__ import annotations

import ctypes
import re

import torch

# The shared objects of the OpenMP runtimes torch is built with (GNU, Intel, LLVM).
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so")


def one_openmp_thread_here() -> None:
    """Run this thread's torch CPU ops on itself alone, without touching other threads.

    A thread that runs a parallel torch op gets an OpenMP team of its own, and once the
    process has more OpenMP threads than cores, the OpenMP runtime stops letting idle
    workers spin: the forward's workers then sleep between its parallel regions, and every
    region waits for them to wake. Measured (docs/benchmarks.md): a thread storing 5 pages
    every 100 ms made a forward step 45% slower; on one thread of its own, 2%.
    ``torch.set_num_threads`` cannot say it for one thread (it also sets the count every
    thread starts with), so this sets the calling thread's OpenMP count directly, after
    torch's per-thread set-up (``get_num_threads`` runs it), which would reset it."""
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (its own copy, by path), or None."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path)  # already loaded: the same handle torch uses
        except OSError:
            continue
        if hasattr(runtime, "omp_set_num_threads"):
            runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
            return runtime
    return None
