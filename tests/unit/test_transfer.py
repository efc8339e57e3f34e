"""io backends on CPU: every layout, page size, dtype and layer selection against the reference.

DirectBackend is run both in its same-device mode and in its staged mode (the
code path used with a CUDA device pool: run grouping, chunking, DMA blocks and
the CPU gather/scatter fallback), which runs on CPU tensors too.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import numpy as np
import pytest
import torch

from hicache.config import IOBackendKind, MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.transfer import DirectBackend, TransferError, create_io_backend, direct
from hicache.transfer.direct import page_runs
from hicache.transfer.kernel import KernelBackend, KernelUnavailableError
from tests.transfer_reference import (
    POISON,
    bits,
    check_round_trip,
    expected_load,
    fill_random,
    make_pools,
    poison,
)

LAYERS = 3
HOST_PAGES, DEVICE_PAGES = 24, 16

# name -> DirectBackend keyword arguments
MODES: dict[str, dict[str, Any]] = {
    "same_device": {},
    "staged_dma": {"staged": True, "min_dma_bytes": 0},  # a DMA per contiguous block
    "staged_gather": {"staged": True, "min_dma_bytes": 1 << 40},  # loads: CPU gather
    "staged_chunked": {"staged": True, "min_dma_bytes": 0, "staging_bytes": 1},  # 1 page/chunk
}


@pytest.mark.parametrize("per_page", [True, False])
@pytest.mark.parametrize("layer", [None, 0, LAYERS - 1])
@pytest.mark.parametrize("layout", list(MemLayout))
def test_same_device_copies_page_by_page_or_all_at_once(
    layout: MemLayout, layer: int | None, per_page: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU pools: large page parts are copied one page at a time, small ones with one
    index_select + index_copy_; both give the reference's bytes."""
    monkeypatch.setattr(direct, "PER_PAGE_COPY_MIN_BYTES", 0 if per_page else 1 << 40)
    batched: list[int] = []
    real = torch.Tensor.index_select

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        batched.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    geometry = KVGeometry(num_layers=LAYERS, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    check_round_trip(geometry, layout, 4, layer, DirectBackend, seed=7)
    assert (not batched) == per_page


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layer", [None, *range(LAYERS)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", list(MemLayout))
def test_direct_round_trip(
    layout: MemLayout, page_size: int, dtype: torch.dtype, layer: int | None, mode: str
) -> None:
    geometry = KVGeometry(num_layers=LAYERS, num_kv_heads=2, head_dim=8, dtype=dtype)
    kwargs = MODES[mode]
    check_round_trip(
        geometry, layout, page_size, layer,
        lambda host, device: DirectBackend(host, device, **kwargs), seed=page_size,
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layer", [None, *range(LAYERS)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(MemLayout))
def test_direct_round_trip_mla(
    layout: MemLayout, page_size: int, dtype: torch.dtype, layer: int | None, mode: str
) -> None:
    # One plane per layer (the MLA latent): every layout's strides and every
    # staged-path block decision differ from the K/V case.
    geometry = KVGeometry.mla(num_layers=LAYERS, latent_dim=16, dtype=dtype)
    kwargs = MODES[mode]
    check_round_trip(
        geometry, layout, page_size, layer,
        lambda host, device: DirectBackend(host, device, **kwargs), seed=page_size + 1,
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layer", [None, 1])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_direct_round_trip_odd_row(
    kind: str, layout: MemLayout, page_size: int, layer: int | None, mode: str
) -> None:
    # kv_heads * head_dim = 24 (or an MLA latent of 24): rows that are not a power of two
    if kind == "mla":
        geometry = KVGeometry.mla(num_layers=LAYERS, latent_dim=24, dtype=torch.float16)
    else:
        geometry = KVGeometry(num_layers=LAYERS, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    kwargs = MODES[mode]
    check_round_trip(
        geometry, layout, page_size, layer,
        lambda host, device: DirectBackend(host, device, **kwargs), seed=7,
    )


def _small_pools(layout: MemLayout = MemLayout.PAGE_FIRST) -> tuple[Any, Any]:
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    return make_pools(geometry, layout, 4, 8, 6)


def test_mismatched_geometry_raises() -> None:
    host, _ = _small_pools()
    other = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    _, device = make_pools(other, MemLayout.PAGE_FIRST, 4, 8, 6)
    with pytest.raises(TransferError, match="do not match"):
        DirectBackend(host, device)
    with pytest.raises(TransferError, match="do not match"):
        create_io_backend("direct", host, device)
    geometry = host.geometry
    _, device = make_pools(geometry, MemLayout.PAGE_FIRST, 8, 8, 6)  # page size 8 vs 4
    with pytest.raises(TransferError, match="do not match"):
        DirectBackend(host, device)
    bf16 = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16)
    _, device = make_pools(bf16, MemLayout.PAGE_FIRST, 4, 8, 6)
    with pytest.raises(TransferError, match="do not match"):
        DirectBackend(host, device)


@pytest.mark.parametrize("staged", [False, True])
def test_bad_page_lists_raise(staged: bool) -> None:
    host, device = _small_pools()
    backend = DirectBackend(host, device, staged=staged)
    ids = torch.tensor([0, 1, 2])
    with pytest.raises(TransferError, match="equally long"):
        backend.load(ids, torch.tensor([0, 1]))
    with pytest.raises(TransferError, match="equally long"):
        backend.store(ids, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(TransferError, match="equally long"):
        backend.load(ids.view(3, 1), ids.view(3, 1))
    with pytest.raises(TransferError, match="int64"):
        backend.load(ids.to(torch.int32), ids.to(torch.int32))
    with pytest.raises(TransferError, match=r"host page ids must lie in \[0, 8\)"):
        backend.load(torch.tensor([0, 8]), torch.tensor([0, 1]))
    with pytest.raises(TransferError, match=r"device page ids must lie in \[0, 6\)"):
        backend.load(torch.tensor([0, 1]), torch.tensor([-1, 1]))
    with pytest.raises(TransferError, match=r"device page ids must lie in \[0, 6\)"):
        backend.store(torch.tensor([6, 1]), torch.tensor([0, 1]))
    with pytest.raises(TransferError, match="layer 2 out of range"):
        backend.load(ids, ids, layer=2)


def test_empty_page_lists_are_a_no_op() -> None:
    host, device = _small_pools()
    fill_random(host.flat, 1)
    poison(device.flat)
    for backend in (DirectBackend(host, device), DirectBackend(host, device, staged=True)):
        empty = torch.zeros(0, dtype=torch.int64)
        backend.load(empty, empty)
        backend.store(empty, empty, layer=1)
    assert bool((device.flat == POISON).all())


def test_create_io_backend_kernel_on_cpu_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    host, device = _small_pools()
    with caplog.at_level(logging.WARNING, logger="hicache.transfer"):
        backend = create_io_backend("kernel", host, device)
    assert type(backend) is DirectBackend
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not on a CUDA device" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.transfer"):
        assert type(create_io_backend(IOBackendKind.DIRECT, host, device)) is DirectBackend
    assert not caplog.records


def test_create_io_backend_rejects_unknown_kind() -> None:
    host, device = _small_pools()
    with pytest.raises(TransferError, match="choose one of: kernel, direct"):
        create_io_backend("dma", host, device)


def test_kernel_backend_on_cpu_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    host, device = _small_pools()
    with pytest.raises(KernelUnavailableError, match=r"not on a CUDA device.*use io backend"):
        KernelBackend(host, device)


def test_kernel_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton the module imports, and the backend refuses with a clear reason."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    for name in ("hicache.transfer.kernel", "hicache.transfer.triton_kernels"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    kernel = importlib.import_module("hicache.transfer.kernel")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU pools pass; Triton is what is missing
    host, device = _small_pools()
    assert kernel.kernel_unavailable_reason(host, device) == "Triton is not installed"
    with pytest.raises(kernel.KernelUnavailableError, match="Triton is not installed"):
        kernel.KernelBackend(host, device)


def test_page_runs() -> None:
    starts, lengths = page_runs(np.array([5, 6, 7, 2, 9, 10, 3, 4, 5, 1]))
    assert starts.tolist() == [0, 3, 4, 6, 9]
    assert lengths.tolist() == [3, 1, 2, 3, 1]
    starts, lengths = page_runs(np.array([4]))
    assert (starts.tolist(), lengths.tolist()) == ([0], [1])
    starts, lengths = page_runs(np.zeros(0, dtype=np.int64))
    assert starts.size == 0 and lengths.size == 0


class _CopyCounter:
    """Counts Tensor.copy_ calls (each one DMA on CUDA) made while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = torch.Tensor.copy_

        def counting_copy(
            tensor: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
        ) -> Any:
            self.calls += 1
            return original(tensor, src, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)


@pytest.mark.parametrize(
    ("planes", "layout", "layer", "copies_per_run"),
    [
        (2, MemLayout.PAGE_FIRST, None, 1),  # a run of pages is one contiguous block
        (2, MemLayout.PAGE_FIRST_DIRECT, None, 1),
        (2, MemLayout.LAYER_FIRST, None, 2 * LAYERS),  # one block per (run, layer, k|v)
        (2, MemLayout.LAYER_FIRST, 1, 2),  # one block per (run, k|v)
        (1, MemLayout.PAGE_FIRST, None, 1),  # MLA: one latent plane per layer
        (1, MemLayout.PAGE_FIRST_DIRECT, None, 1),
        (1, MemLayout.LAYER_FIRST, None, LAYERS),  # one block per (run, layer)
        (1, MemLayout.LAYER_FIRST, 1, 1),
    ],
)
def test_staged_copies_scale_with_runs_not_pages(
    monkeypatch: pytest.MonkeyPatch, planes: int, layout: MemLayout, layer: int | None,
    copies_per_run: int,
) -> None:
    if planes == 1:
        geometry = KVGeometry.mla(num_layers=LAYERS, latent_dim=16, dtype=torch.float32)
    else:
        geometry = KVGeometry(num_layers=LAYERS, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    host, device = make_pools(geometry, layout, 16, HOST_PAGES, DEVICE_PAGES)
    backend = DirectBackend(host, device, staged=True, min_dma_bytes=0)
    host_pages = torch.tensor([3, 4, 5, 6, 12, 13, 14, 0, 1, 2])  # 3 runs, 10 pages
    device_pages = torch.tensor([9, 2, 11, 0, 4, 3, 15, 7, 8, 1])
    fill_random(host.flat, 3)
    poison(device.flat)
    want = expected_load(host, device, host_pages, device_pages, layer)
    counter = _CopyCounter(monkeypatch)
    backend.load(host_pages, device_pages, layer)
    assert counter.calls == 3 * copies_per_run
    assert torch.equal(bits(device.flat), bits(want))
