"""Run a function on every rank of a tensor-parallel group: one spawned process per rank.

``run_ranks(target, size, arg)`` starts ``size`` processes, each joins a gloo group over
loopback (``init_tp_group``) and returns ``target(tp, arg)``; the parent gets the
results in rank order. Results travel as ``torch.save`` bytes (not shared memory, which
a finished child could take with it). A rank that raises fails the call with its
traceback; a group that does not finish within ``timeout_s`` fails it too, and every
child is killed in any case: a broken collective never hangs the test session.

``target`` must be a module-level function of a module that imports quickly (no
transformers): each child imports it afresh.
"""

from __future__ import annotations

import io
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from hicache.distributed.group import TPGroup, init_tp_group

# Collectives fail (not hang) after this long without the other ranks: long enough for a
# rank that a loaded machine slows (a busy 2-core machine builds a rank in tens of seconds).
COLLECTIVE_TIMEOUT_S = 120.0
# A group that has not finished by then failed: a guard against a hang, not a bound on speed.
RUN_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(
    target: Callable[[TPGroup, Any], Any], size: int, arg: Any = None,
    timeout_s: float = RUN_TIMEOUT_S,
) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[tuple[int, bool, bytes | str]] = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(
            target=_rank_main, args=(target, rank, size, init_method, arg, results), daemon=True
        )
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)


def _collect(
    processes: list[Any], results: Any, timeout_s: float
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    while len(got) < len(processes):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"ranks {sorted(set(range(len(processes))) - set(got))} did not "
                               f"finish within {timeout_s} s")
        try:
            rank, ok, payload = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if dead and all(i not in got for i in dead):
                # Its report (if any) would have arrived before it exited; give it one more try.
                try:
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError(
                        f"rank {dead[0]} died (exit code {processes[dead[0]].exitcode})"
                    ) from None
            else:
                continue
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{payload}")
        assert isinstance(payload, bytes)
        got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [got[rank] for rank in range(len(processes))]


def _rank_main(
    target: Callable[[TPGroup, Any], Any],
    rank: int,
    size: int,
    init_method: str,
    arg: Any,
    results: Any,
) -> None:
    # The ranks share the machine's cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    try:
        tp = init_tp_group(rank, size, init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
        try:
            value = target(tp, arg)
        finally:
            tp.destroy()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
