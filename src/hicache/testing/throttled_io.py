"""A slow host->device path: an io backend that holds each load (L2 -> L1) to a chosen
latency and bandwidth, for benchmarks that measure a host hit against recomputing it.

The L3 counterpart is the ``throttled`` storage backend; this one throttles the next hop,
and only in process: ``throttle_loads`` puts it in front of a built engine's cache
controller and ``unthrottle_loads`` puts the original back. No server flag reaches it.

Invariants:
- A load of ``nbytes`` over all its layers is held ``latency_s + nbytes / bandwidth``
  longer than unthrottled: the controller loads one layer per call (``CacheController.
  load``), so the first layer's call (layer 0, or a whole-page call with ``layer=None``)
  waits the latency plus its bytes' time, every later layer its bytes' time only. A
  layer's bytes are its pages' share of a page (``page_bytes / num_layers`` each): the
  forward, which waits per layer, sees layer N land N+1 shares after the latency.
- Stores (device -> host writes) are the wrapped backend's, untouched; an empty page list
  is not delayed. Every byte moved is the wrapped backend's: only the timing changes.
- The wait happens before the wrapped copy, on the thread the controller runs the load
  on, never on the scheduler's. On a CPU device that is the load executor's thread: the
  thread sleeps, so the load's completion, ``load_seconds`` and the (pages, seconds)
  samples the cost model takes (``take_load_samples``) all include the wait. On CUDA the
  executor enqueues the load on its stream from the calling (scheduler) thread, and a
  host sleep there would stall every request; so the wait is enqueued instead, as a GPU
  spin on the load stream ahead of the copy (calibrated once against CUDA events): the
  copy starts that much later on the stream, the scheduler thread never waits, and the
  load's timing events (hence its samples) include the delay.
- Bandwidth is shared the way one link's is: the controller issues every load on one
  executor, in order (one thread, or one stream), so loads in flight at once queue
  behind each other and their waits add up, as the throttled storage backend's shared
  bandwidth does for parallel calls. Latency is per load.
- Loads the controller checks while copying (``load_verified``: pages read from L3 whose
  checksum is not verified yet, on a CPU device) do not go through the io backend and are
  not throttled; a host hit of pages the device wrote is an ordinary load and is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.controller.controller import CacheController
from hicache.transfer.base import IOBackend

Wait = Callable[[float], None]

# How long the CUDA calibration spin runs: long enough that launch overheads are noise.
_CALIBRATION_S = 0.02
_ASSUMED_CLOCK_HZ = 1.5e9  # a first guess, only to size the calibration spin


@dataclass(frozen=True)
class LoadThrottle:
    """The latency (seconds, once per load) and bandwidth (bytes per second; None: no
    limit) a host->device load is held to."""

    latency_s: float = 0.0
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency_s}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {self.bandwidth}")

    def delay_s(self, nbytes: int, first: bool) -> float:
        """The wait of one call moving ``nbytes``; ``first``: it starts a load."""
        delay = self.latency_s if first else 0.0
        if self.bandwidth is not None:
            delay += nbytes / self.bandwidth
        return delay


class StreamSleep:
    """Holds the current CUDA stream for a number of seconds without blocking the host:
    a one-thread GPU spin of a number of cycles, converted from seconds with the rate
    measured once at construction (the clock may drift with boost: the load's own
    timing events, not this estimate, are what the cost model sees)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cycles = int(_CALIBRATION_S * _ASSUMED_CLOCK_HZ)
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)  # warm-up: the first launch loads the kernel
            began = torch.cuda.Event(enable_timing=True)
            ended = torch.cuda.Event(enable_timing=True)
            began.record()
            torch.cuda._sleep(cycles)
            ended.record()
            ended.synchronize()
            self.cycles_per_s = cycles / (began.elapsed_time(ended) / 1e3)

    def __call__(self, seconds: float) -> None:
        torch.cuda._sleep(int(seconds * self.cycles_per_s))


def default_wait(device: torch.device) -> Wait:
    """How a load on ``device`` waits (see the module docstring): a host sleep on the
    load thread on CPU, a spin on the load stream on CUDA."""
    if device.type == "cuda":
        return StreamSleep(device)
    return time.sleep


class ThrottledIO(IOBackend):
    """Another io backend's copies, each load held to a ``LoadThrottle``."""

    name = "throttled"

    def __init__(self, inner: IOBackend, throttle: LoadThrottle, wait: Wait | None = None) -> None:
        """``wait`` replaces how the delay is spent (tests: a recorder, no sleeping)."""
        super().__init__(inner.host, inner.device)
        self.inner = inner
        self.throttle = throttle
        self._wait = wait if wait is not None else default_wait(inner.device.device)
        geometry = inner.host.geometry
        self.page_bytes = geometry.page_bytes(inner.host.page_size)
        self.layer_page_bytes = self.page_bytes // geometry.num_layers
        self._lock = threading.Lock()
        self._waited_s = 0.0

    @property
    def waited_s(self) -> float:
        """The delay imposed so far, summed over loads (any thread)."""
        with self._lock:
            return self._waited_s

    def load(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        num_pages = int(host_pages.numel())
        if num_pages:
            per_page = self.page_bytes if layer is None else self.layer_page_bytes
            delay = self.throttle.delay_s(num_pages * per_page, first=layer in (None, 0))
            if delay > 0:
                self._wait(delay)
                with self._lock:
                    self._waited_s += delay
        self.inner.load(host_pages, device_pages, layer)

    def store(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        self.inner.store(device_pages, host_pages, layer)


def throttle_loads(
    controller: CacheController, throttle: LoadThrottle, wait: Wait | None = None
) -> ThrottledIO:
    """Hold ``controller``'s loads issued from now on to ``throttle``; returns the wrapper.

    Call it where no load is being issued (on the scheduler's thread, or while the engine
    is idle): a load already issued keeps the io backend it started with.
    """
    if isinstance(controller.io, ThrottledIO):
        raise RuntimeError("the controller's loads are throttled already: unthrottle first")
    throttled = ThrottledIO(controller.io, throttle, wait)
    controller.io = throttled
    return throttled


def unthrottle_loads(controller: CacheController) -> None:
    """Give ``controller`` back the io backend ``throttle_loads`` wrapped (no-op if none)."""
    if isinstance(controller.io, ThrottledIO):
        controller.io = controller.io.inner
