"""Checksums taken in the page copies of a CPU device (transfer.digesting, memory.page_digests).

The digest a copy computes must be exactly the L3 frame's checksum of the host
page (xxh3_128 of its payload in payload order), for every host layout, MHA and
MLA pages, and any piece size; a load must refuse the first EXPECTED page whose
bytes do not hash to their digest and copy the rest exactly like a plain copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.memory.page_digests import DigestState, PageDigests
from hicache.storage.frame import checksum
from hicache.storage.page_regions import PageRegions
from hicache.transfer.base import TransferError
from hicache.transfer.digesting import DigestingCopier

MHA = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
MLA = KVGeometry.mla(num_layers=2, latent_dim=24, dtype=torch.float32)
PAGE_SIZE = 8


def pools(geometry: KVGeometry, layout: MemLayout) -> tuple[HostPool, DevicePool]:
    host = HostPool(geometry, 12, PAGE_SIZE, layout, pin_memory=False)
    device = DevicePool(geometry, 6, PAGE_SIZE, "cpu")
    generator = torch.Generator().manual_seed(0)
    device.flat.copy_(torch.randn(device.flat.shape, generator=generator).to(geometry.dtype))
    return host, device


def page_checksum(host: HostPool, page: int) -> bytes:
    return checksum(PageRegions(host).views(page))


CASES = [
    pytest.param(geometry, layout, piece, id=f"{name}-{layout.value}-piece{piece}")
    for name, geometry in (("mha", MHA), ("mla", MLA))
    for layout in MemLayout
    for piece in (40, 96, 1100, 1 << 20)  # a row or less, a few rows, layers, a whole page
]


@pytest.mark.parametrize(("geometry", "layout", "piece"), CASES)
def test_a_write_copies_pages_and_records_their_frame_checksum(
    geometry: KVGeometry, layout: MemLayout, piece: int
) -> None:
    host, device = pools(geometry, layout)
    copier = DigestingCopier(host, device, piece_bytes=piece)
    device_pages, host_pages = np.array([4, 0, 2]), np.array([7, 1, 10])
    copier.store(device_pages, host_pages)
    for d, h in zip(device_pages, host_pages, strict=True):
        assert torch.equal(host.pages[h].view(torch.uint8), device.pages[d].view(torch.uint8))
        assert host.digests.state(int(h)) is DigestState.KNOWN
        assert host.digests.digest(int(h)) == page_checksum(host, int(h))
    assert host.digests.state(0) is DigestState.UNKNOWN


@pytest.mark.parametrize(("geometry", "layout", "piece"), CASES)
def test_a_verified_load_stops_at_the_first_damaged_page(
    geometry: KVGeometry, layout: MemLayout, piece: int
) -> None:
    host, device = pools(geometry, layout)
    writer = DigestingCopier(host, device)
    writer.store(np.arange(4), np.array([3, 4, 5, 6]))
    for page in (3, 4, 5, 6):  # as if read back from L3: claimed, not yet verified
        digest = host.digests.digest(page)
        assert digest is not None
        host.digests.expect(page, digest)
    original = device.pages[:4].clone()
    host.pages[5, geometry.num_layers - 1, 0, PAGE_SIZE - 1, 0] += 1  # one element of page 5
    device.flat.zero_()
    copier = DigestingCopier(host, device, piece_bytes=piece)
    assert copier.load_verified(np.array([3, 4, 5, 6]), np.array([5, 4, 3, 2])) == 2
    assert torch.equal(device.pages[5].view(torch.uint8), original[0].view(torch.uint8))
    assert torch.equal(device.pages[4].view(torch.uint8), original[1].view(torch.uint8))
    assert not device.pages[2].any(), "pages after the damaged one were copied"
    assert [host.digests.state(p) for p in (3, 4, 5, 6)] == [
        DigestState.KNOWN, DigestState.KNOWN, DigestState.EXPECTED, DigestState.EXPECTED,
    ]


def test_pages_not_read_from_l3_are_copied_without_a_check() -> None:
    host, device = pools(MHA, MemLayout.LAYER_FIRST)
    DigestingCopier(host, device).store(np.array([0, 1]), np.array([0, 1]))
    host.digests.set_known(1, bytes(16))  # wrong, but KNOWN pages are trusted
    host.digests.forget([0])
    target = DevicePool(MHA, 2, PAGE_SIZE, "cpu")
    assert DigestingCopier(host, target).load_verified(np.array([0, 1]), np.array([1, 0])) == 2
    assert torch.equal(target.pages[1], device.pages[0])
    assert torch.equal(target.pages[0], device.pages[1])


def test_a_copier_refuses_pools_it_cannot_serve() -> None:
    host, device = pools(MHA, MemLayout.PAGE_FIRST)
    with pytest.raises(TransferError, match="do not match"):
        DigestingCopier(host, DevicePool(MLA, 2, PAGE_SIZE, "cpu"))
    with pytest.raises(TransferError, match="piece_bytes"):
        DigestingCopier(host, device, piece_bytes=0)


def test_page_digests_keep_a_state_and_a_digest_per_page() -> None:
    digests = PageDigests(4)
    assert digests.digest(2) is None and digests.state(2) is DigestState.UNKNOWN
    digests.set_known(2, b"k" * 16)
    digests.expect(3, b"e" * 16)
    assert digests.digest(2) == b"k" * 16 and digests.state(2) is DigestState.KNOWN
    assert digests.digest(3) == b"e" * 16 and digests.state(3) is DigestState.EXPECTED
    assert digests.expected(np.array([0, 2, 3])).tolist() == [False, False, True]
    digests.forget(np.array([2, 3]))
    assert digests.digest(2) is None and digests.digest(3) is None
    with pytest.raises(ValueError, match="16 bytes"):
        digests.set_known(0, b"short")


def test_a_layer_first_page_is_hashed_in_one_call_a_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hash call hands the GIL over: a page's scattered runs are staged and hashed a
    piece at a time, not one call a run."""
    import hicache.transfer.digesting as digesting

    calls: list[int] = []
    real = digesting.xxhash.xxh3_128

    class Counting:
        def __init__(self) -> None:
            self._hasher = real()

        def update(self, data: object) -> None:
            calls.append(1)
            self._hasher.update(data)

        def digest(self) -> bytes:
            return self._hasher.digest()

    host, device = pools(MHA, MemLayout.LAYER_FIRST)
    run = PAGE_SIZE * MHA.row_elems * MHA.element_bytes  # one (layer, plane) run: 256 bytes
    copier = DigestingCopier(host, device, piece_bytes=4 * run)  # two layers a piece
    monkeypatch.setattr(digesting.xxhash, "xxh3_128", Counting)
    copier.store(np.array([1]), np.array([2]))
    assert len(calls) == 2  # three layers: two pieces (6 runs)
    assert host.digests.digest(2) == page_checksum(host, 2)
