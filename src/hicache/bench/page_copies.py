"""Where ``hicache bench storage`` puts the checksum's cost: the page copies of a CPU device.

With a CPU device the cache checksums a page while it copies it into the host
pool (L1 -> L2) and verifies a page read from L3 while it copies it to the
device (L2 -> L1): ``transfer.digesting``, ``memory.page_digests``. The L3
put and get then neither hash nor verify. So that a run shows what that moved
cost, this times those two copies of the run's pages with the checksum
(``DigestingCopier``) next to the same copies without it, median of the run's
repeats after a warm-up: rows "copy + checksum" and its baseline. Rows "direct
copy" time the cache's other copies of a CPU device (``DirectBackend``, whole
pages by index; loads of pages not read from L3 use it, a layer at a time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.digesting import DigestingCopier
from hicache.transfer.direct import DirectBackend

NAME = "copy + checksum"
BASELINE_LABEL = (
    "the same page copies of a CPU device without the checksum (transfer.digesting: a "
    "piece at a time); write = L1 -> L2, load = L2 -> L1 of every layer, the checked load "
    "verifying pages read from L3. Also timed: the cache's plain per-layer copies "
    "(transfer.direct), rows \"direct copy\""
)
DIRECT = "direct copy"


def fill_through_device(host: HostPool, pages: np.ndarray, data: torch.Tensor) -> DevicePool:
    """Put ``data`` ([n, layers, planes, page_size, row]) in host ``pages`` the way the
    cache does on a CPU device: into device pages first, then the checksumming write.
    Returns the device pool (pages 0..n-1 hold ``data``)."""
    device = DevicePool(host.geometry, len(pages), host.page_size, "cpu")
    device.pages[:] = data
    DigestingCopier(host, device).store(np.arange(len(pages)), pages)
    return device


def measure_copies(
    host: HostPool, device: DevicePool, source: np.ndarray, target: np.ndarray, repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds per round of the write (device pages -> host ``source``) and the load
    (host ``target``, read from L3 and so EXPECTED, -> device pages), checked and plain.

    Returns {kind: (write_s, load_s)} for kinds "checked", "unchecked" (the same copies
    without the checksum) and "direct" (transfer.direct's)."""
    copier = DigestingCopier(host, device)
    plain = DirectBackend(host, device, staged=False)
    device_ids = np.arange(len(source))
    digests = host.digests
    claimed = [digests.digest(int(page)) for page in target]
    if any(digest is None for digest in claimed):
        raise RuntimeError("the target pages have no checksum to verify (read them from L3)")

    def expect_again() -> None:  # a verified load makes them KNOWN
        for page, digest in zip(target, claimed, strict=True):
            assert digest is not None
            digests.expect(int(page), digest)

    def load_checked() -> None:
        good = copier.load_verified(target, device_ids)
        if good != len(target):
            raise RuntimeError(f"verified load: page {good} failed its checksum")

    device_t, source_t, target_t = (torch.from_numpy(a) for a in (device_ids, source, target))
    variants: list[tuple[str, Callable[[], object], Callable[[], object], Callable[[], None]]] = [
        ("checked", lambda: copier.store(device_ids, source), load_checked, expect_again),
        # Target pages KNOWN: load_verified copies them without a check.
        ("unchecked", lambda: copier.store(device_ids, source, checksum=False),
         lambda: copier.load_verified(target, device_ids), lambda: None),
        ("direct", lambda: plain.store(device_t, source_t), lambda: plain.load(target_t, device_t),
         lambda: None),
    ]
    timed: dict[str, tuple[list[float], list[float]]] = {}
    for kind, write, load, before_load in variants:
        timed[kind] = (_timed(write, repeats), _timed(load, repeats, before_load))
    copier.store(device_ids, source)  # as they were: checksummed,
    expect_again()  # and the targets unverified
    return timed


def _timed(
    fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None
) -> list[float]:
    samples: list[float] = []
    for round_index in range(1 + repeats):
        before()
        began = time.perf_counter()
        fn()
        if round_index:
            samples.append(time.perf_counter() - began)
    return samples
