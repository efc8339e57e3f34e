"""CacheController: owns the transfer executors and the queues of in-flight copies.

It knows pages, not trees: the cache orchestrator tells it what to copy and
learns, by polling, which writes have landed. Writes (L1 -> L2) run on one
executor and are acknowledged strictly in submission order; loads (L2 -> L1)
run on another, one submission per layer, so the model can start computing
layer N while layer N+1 is still in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.controller.executor import Completion, Executor, create_executor
from hicache.memory.allocator import PageIds
from hicache.transfer.base import IOBackend
from hicache.transfer.digesting import DigestingCopier

logger = logging.getLogger(__name__)

MAX_LOAD_SAMPLES = 256


@dataclass(frozen=True)
class PendingWrite:
    """A device->host copy in flight, acknowledged by ``token`` once landed."""

    token: int
    num_pages: int
    completion: Completion


@dataclass(frozen=True)
class LoadBatch:
    """A host->device load in flight: one completion per layer."""

    num_pages: int
    layers: tuple[Completion, ...]

    def done(self) -> bool:
        return self.layers[-1].query()


def _as_tensor(pages: PageIds) -> torch.Tensor:
    return torch.from_numpy(pages.astype("int64", copy=False))


class CacheController:
    def __init__(self, io: IOBackend) -> None:
        self.io = io
        # On a CPU device: copies that checksum host pages on the way (L3's frame
        # checksum, taken while the bytes are in cache; transfer.digesting).
        self.copier = (
            DigestingCopier(io.host, io.device) if io.device.device.type == "cpu" else None
        )
        self.num_layers = io.host.geometry.num_layers
        self._device = io.device.device
        self._write_executor: Executor | None = None
        self._load_executor: Executor | None = None
        self._writes: deque[PendingWrite] = deque()
        self._last_load: LoadBatch | None = None
        self.num_written_pages = 0
        self.num_loaded_pages = 0
        # Time the loads' copies took (what a router prices a host hit with). On CUDA
        # each load is bracketed by timing events, read once its copies landed.
        self._load_seconds = 0.0
        self._timed_loads: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()
        self._timing_lock = threading.Lock()
        # Each landed load's (pages, seconds), for the cost model to take (bounded: a
        # cache without one keeps the newest only).
        self._load_samples: deque[tuple[int, float]] = deque(maxlen=MAX_LOAD_SAMPLES)

    # ------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self._write_executor is not None

    def start(self) -> None:
        if self.running:
            return
        self._write_executor = create_executor(self._device, "hicache-write")
        self._load_executor = create_executor(self._device, "hicache-load")

    def stop(self) -> None:
        """Let in-flight copies land, then release streams and threads."""
        for executor in (self._write_executor, self._load_executor):
            if executor is not None:
                executor.close()
        self._write_executor = self._load_executor = None

    def _executors(self) -> tuple[Executor, Executor]:
        if self._write_executor is None or self._load_executor is None:
            raise RuntimeError("CacheController is not started")
        return self._write_executor, self._load_executor

    # ----------------------------------------------------------------- write
    def write(
        self, device_pages: PageIds, host_pages: PageIds, token: int, digest: bool = False
    ) -> None:
        """Copy device pages to host pages; ``token`` comes back from poll_writes once landed.

        ``digest``: also checksum each host page (for L3) while copying, where the
        device is the CPU; otherwise the host pages' digests are left unknown.
        """
        write_executor, _ = self._executors()
        self.io.host.digests.forget(host_pages)
        copier = self.copier if digest else None
        if copier is not None:
            completion = write_executor.submit(lambda: copier.store(device_pages, host_pages))
        else:
            src, dst = _as_tensor(device_pages), _as_tensor(host_pages)
            completion = write_executor.submit(lambda: self.io.store(src, dst))
        self._writes.append(PendingWrite(token, len(device_pages), completion))

    def poll_writes(self) -> list[int]:
        """Tokens of writes that have landed, in submission order; never blocks."""
        return self.take_writes(self.num_landed_writes())

    def num_landed_writes(self) -> int:
        """How many of the oldest writes have landed, counted in submission order
        (stopping at the first still in flight); never blocks, acknowledges nothing.

        With ``take_writes`` it splits ``poll_writes`` in two, so that ranks of a
        tensor-parallel group can agree on a count (their minimum) before acknowledging.
        """
        count = 0
        for pending in self._writes:
            if not pending.completion.query():
                break
            count += 1
        return count

    def take_writes(self, count: int) -> list[int]:
        """Acknowledge the ``count`` oldest writes; their tokens, in submission order.

        ``count`` must not exceed ``num_landed_writes()`` as observed (or agreed) since:
        a write counted as landed stays landed, so this never blocks on a copy.
        """
        if count > len(self._writes):
            raise ValueError(f"take_writes({count}): only {len(self._writes)} writes pending")
        return [self._finish_write(self._writes.popleft()) for _ in range(count)]

    def wait_writes(self) -> list[int]:
        """Block until every submitted write has landed; returns their tokens."""
        done: list[int] = []
        while self._writes:
            done.append(self._finish_write(self._writes.popleft()))
        return done

    def _finish_write(self, pending: PendingWrite) -> int:
        pending.completion.wait()  # re-raises a failed copy instead of acking it
        self.num_written_pages += pending.num_pages
        return pending.token

    @property
    def num_pending_writes(self) -> int:
        return len(self._writes)

    # ------------------------------------------------------------------ load
    def load(self, host_pages: PageIds, device_pages: PageIds) -> LoadBatch:
        """Copy host pages into device pages, layer by layer."""
        _, load_executor = self._executors()
        src, dst = _as_tensor(host_pages), _as_tensor(device_pages)
        io = self.io
        on_cuda = self._device.type == "cuda"
        if on_cuda:
            began = torch.cuda.Event(enable_timing=True)
            load_executor.submit(began.record)  # on the load stream, before the copies

        num_pages, last = len(host_pages), self.num_layers - 1
        spent = [0.0]  # this load's copy time so far (the load thread alone writes it)

        def load_layer(layer: int) -> Callable[[], None]:
            if on_cuda:
                return lambda: io.load(src, dst, layer=layer)

            def timed() -> None:  # runs on the load thread: the copy itself
                start = time.perf_counter()
                io.load(src, dst, layer=layer)
                seconds = time.perf_counter() - start
                spent[0] += seconds
                with self._timing_lock:
                    self._load_seconds += seconds
                    if layer == last:  # layers run in order: the load has landed
                        self._load_samples.append((num_pages, spent[0]))

            return timed

        layers = tuple(load_executor.submit(load_layer(layer)) for layer in range(self.num_layers))
        if on_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            load_executor.submit(ended.record)
            with self._timing_lock:
                self._timed_loads.append((began, ended, num_pages))
        batch = LoadBatch(len(host_pages), layers)
        self._last_load = batch
        self.num_loaded_pages += len(host_pages)
        return batch

    def load_verified(self, host_pages: PageIds, device_pages: PageIds) -> int:
        """Copy host pages into device pages whole, checking the pages read from L3 whose
        payload is unverified (EXPECTED digests) on the way; waits for the copy.

        Returns how many leading pages are good (``DigestingCopier.load_verified``); the
        device pages past them must not be used. CPU devices only (``copier``).
        """
        _, load_executor = self._executors()
        copier = self.copier
        if copier is None:
            raise RuntimeError("verified loads need a CPU device pool")
        result: list[int] = []

        def run() -> None:
            start = time.perf_counter()
            result.append(copier.load_verified(host_pages, device_pages))
            seconds = time.perf_counter() - start
            with self._timing_lock:
                self._load_seconds += seconds
                self._load_samples.append((len(host_pages), seconds))

        completion = load_executor.submit(run)  # after every load issued before it
        completion.wait()
        self._last_load = LoadBatch(len(host_pages), (completion,) * self.num_layers)
        self.num_loaded_pages += result[0]
        return result[0]

    def wait_layer(self, layer: int) -> None:
        """Before computing ``layer``: order it after every load issued so far.

        Loads run in order on one executor, so the newest load's completion for
        this layer implies all earlier loads' completions for every layer.
        """
        batch = self._last_load
        if batch is not None:
            batch.layers[layer].wait_on_stream()

    @property
    def load_seconds(self) -> float:
        """Seconds the host->device copies of landed loads took, summed (any thread)."""
        with self._timing_lock:
            self._settle_timed_loads()
            return self._load_seconds

    def take_load_samples(self) -> list[tuple[int, float]]:
        """The (pages, seconds) of each load landed since the last call (any thread)."""
        with self._timing_lock:
            self._settle_timed_loads()
            if not self._load_samples:
                return []
            samples = list(self._load_samples)
            self._load_samples.clear()
            return samples

    def _settle_timed_loads(self) -> None:
        """On CUDA: account the loads whose timing events completed (under the lock)."""
        while self._timed_loads and self._timed_loads[0][1].query():
            began, ended, num_pages = self._timed_loads.popleft()
            seconds = began.elapsed_time(ended) / 1e3  # ms
            self._load_seconds += seconds
            self._load_samples.append((num_pages, seconds))

    def wait_loads(self) -> None:
        batch = self._last_load
        if batch is not None:
            batch.layers[-1].wait()
            self._last_load = None
