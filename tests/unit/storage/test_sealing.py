"""Sealed pages: AES-GCM under the tenant's key, opened in place, any mismatch a miss."""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.call_tenant import call_tenant
from hicache.storage.frame import (
    SEALED_HEADER_BYTES,
    Fault,
    PayloadOrder,
    check_header,
    encode_header,
    sealed_fields,
)
from hicache.storage.page_regions import PageRegions
from hicache.storage.sealing import Sealer
from hicache.tenancy.keys import KeyRing, parse_key_file
from tests.storage_contract import fill_random, page_range

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16)
KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
A1, A2, B1, STAR = "a1" * 32, "a2" * 32, "b1" * 32, "ee" * 32


def ring(text: str) -> KeyRing:
    return parse_key_file(text, "test.keys")


RING = ring(f"acme 1 {A1}\nglobex 1 {B1}\n* 9 {STAR}\n")


def regions_of(layout: MemLayout, sealer: Sealer | None, pages: int = 6) -> PageRegions:
    host = HostPool(GEOMETRY, pages, 4, layout, pin_memory=False)
    fill_random(host, page_range(0, pages), seed=7)
    return PageRegions(host, sealer)


def seal(regions: PageRegions, page: int, key: bytes, tenant: str | None) -> tuple[bytes, bytes]:
    """(ciphertext, header) of ``page`` sealed for ``tenant``."""
    staging = regions.staging_for(1)
    with call_tenant(tenant):
        framed = regions.frame(page, key, staging)
    assert framed is not None
    payload, header = framed
    return b"".join(bytes(p) for p in payload), header


def land(regions: PageRegions, page: int, ciphertext: bytes, header: bytes, key: bytes,
         tenant: str | None) -> Fault | None:
    """Read an object into ``page`` as a backend does: copy in, check, open in place."""
    regions.copy_in(page, ciphertext)
    with call_tenant(tenant):
        return regions.check_header(header, key) or regions.check_landed(header, page, True)


def plain(regions: PageRegions, page: int) -> bytes:
    return b"".join(bytes(v) for v in regions.views(page))


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_sealed_page_round_trips_in_every_layout(layout: MemLayout) -> None:
    regions = regions_of(layout, Sealer(RING))
    assert regions.header_bytes == SEALED_HEADER_BYTES
    original = plain(regions, 1)
    ciphertext, header = seal(regions, 1, KEY, "acme")
    assert len(ciphertext) == regions.page_bytes and len(header) == SEALED_HEADER_BYTES
    assert ciphertext != original and original not in ciphertext + header
    assert plain(regions, 1) == original, "sealing must not touch the host page"
    assert land(regions, 4, ciphertext, header, KEY, "acme") is None
    assert plain(regions, 4) == original
    assert regions.digests.digest(4) is None  # the tag, not a checksum, vouched for it


def test_nonces_are_fresh_and_the_key_id_is_in_the_header() -> None:
    regions = regions_of(MemLayout.PAGE_FIRST, Sealer(RING))
    first, header1 = seal(regions, 0, KEY, "acme")
    second, header2 = seal(regions, 0, KEY, "acme")
    _, nonce1, key_id = sealed_fields(header1)
    _, nonce2, _ = sealed_fields(header2)
    assert key_id == 1 and nonce1 != nonce2 and first != second
    assert sealed_fields(seal(regions, 0, KEY, "initech")[1])[2] == 9  # the '*' key


def test_a_page_under_another_name_fails_authentication() -> None:
    """The page key is associated data: a sealed object moved to another page's name
    (header rewritten to match) does not open."""
    regions = regions_of(MemLayout.PAGE_FIRST, Sealer(RING))
    ciphertext, header = seal(regions, 0, KEY, "acme")
    moved = header[:16] + OTHER_KEY + header[32:]
    assert land(regions, 3, ciphertext, moved, OTHER_KEY, "acme") is Fault.BAD_TAG
    # Unmodified, the header names its own key: the plain key check catches that first.
    assert land(regions, 3, ciphertext, header, OTHER_KEY, "acme") is Fault.WRONG_KEY


def test_damage_to_the_payload_or_the_header_is_a_miss() -> None:
    regions = regions_of(MemLayout.LAYER_FIRST, Sealer(RING))
    ciphertext, header = seal(regions, 0, KEY, "acme")
    flipped = bytearray(ciphertext)
    flipped[len(flipped) // 2] ^= 1
    assert land(regions, 3, bytes(flipped), header, KEY, "acme") is Fault.BAD_TAG
    nonce_flipped = bytearray(header)
    nonce_flipped[50] ^= 1
    assert land(regions, 3, ciphertext, bytes(nonce_flipped), KEY, "acme") is Fault.BAD_TAG


def test_another_tenant_or_a_missing_key_id_is_a_miss() -> None:
    regions = regions_of(MemLayout.PAGE_FIRST, Sealer(RING))
    ciphertext, header = seal(regions, 0, KEY, "acme")
    # globex has a key id 1 too, with another secret: the tag fails.
    assert land(regions, 3, ciphertext, header, KEY, "globex") is Fault.BAD_TAG
    # initech reads with the '*' keys, which have no key id 1.
    assert land(regions, 3, ciphertext, header, KEY, "initech") is Fault.UNKNOWN_KEY
    # An instance whose key file lost acme's key 1 (crypto-shredded).
    shredded = regions_of(MemLayout.PAGE_FIRST, Sealer(ring(f"acme 2 {A2}\n")))
    assert land(shredded, 3, ciphertext, header, KEY, "acme") is Fault.UNKNOWN_KEY


def test_rotation_writes_with_the_last_key_and_reads_with_all() -> None:
    before = regions_of(MemLayout.PAGE_FIRST, Sealer(ring(f"acme 1 {A1}\n")))
    old_ciphertext, old_header = seal(before, 0, KEY, "acme")
    rotated = regions_of(MemLayout.PAGE_FIRST, Sealer(ring(f"acme 1 {A1}\nacme 2 {A2}\n")))
    original = plain(rotated, 0)
    assert original == plain(before, 0)  # the same seed filled both pools
    new_ciphertext, new_header = seal(rotated, 0, KEY, "acme")
    assert sealed_fields(new_header)[2] == 2
    assert land(rotated, 3, old_ciphertext, old_header, KEY, "acme") is None
    assert plain(rotated, 3) == original
    assert land(rotated, 4, new_ciphertext, new_header, KEY, "acme") is None
    assert plain(rotated, 4) == original
    # The old instance cannot read what the rotated key wrote.
    assert land(before, 3, new_ciphertext, new_header, KEY, "acme") is Fault.UNKNOWN_KEY


def test_a_tenant_without_a_key_is_never_written() -> None:
    regions = regions_of(MemLayout.PAGE_FIRST, Sealer(ring(f"acme 1 {A1}\n")))
    staging = regions.staging_for(1)
    assert staging is not None
    staging[:] = bytes(len(staging))
    with call_tenant("globex"):
        assert regions.frame(0, KEY, staging) is None
    with call_tenant(None):
        assert regions.frame(0, KEY, staging) is None
    assert not any(staging), "nothing of the page may reach the staging buffer"


def test_sealed_and_plain_instances_read_each_other_as_a_version_mismatch() -> None:
    sealed = regions_of(MemLayout.PAGE_FIRST, Sealer(RING))
    clear = regions_of(MemLayout.PAGE_FIRST, None)
    assert clear.staging_for(2) is None and clear.header_bytes == 48
    _, header = seal(sealed, 0, KEY, "acme")
    order = PayloadOrder.TOKEN_MAJOR
    assert check_header(header, KEY, order, clear.page_bytes) is Fault.BAD_VERSION
    plain_header = encode_header(KEY, order, clear.page_bytes, bytes(16)) + bytes(16)
    assert sealed.check_header(plain_header, KEY) is Fault.BAD_VERSION


def test_staging_is_reused_by_the_thread() -> None:
    sealer = Sealer(RING)
    first = sealer.staging(1000)
    assert len(first) == 1000 and len(sealer.staging(10)) == 10
    assert first.obj is sealer.staging(500).obj


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_payload_handed_back_by_a_store_is_decrypted_into_the_page(
    layout: MemLayout,
) -> None:
    """``land``: a store's own copy of the ciphertext is decrypted straight into the page's
    regions (no copy first); the same for a plain page is a copy and its check."""
    regions = regions_of(layout, Sealer(RING))
    original = plain(regions, 2)
    ciphertext, header = seal(regions, 2, KEY, "acme")
    with call_tenant("acme"):
        assert regions.land(header, 5, ciphertext, True) is None
        assert plain(regions, 5) == original
        damaged = bytearray(ciphertext)
        damaged[-1] ^= 0x80
        assert regions.land(header, 4, bytes(damaged), True) is Fault.BAD_TAG
    clear = regions_of(layout, None)
    payload = plain(clear, 1)
    framed = clear.frame(1, KEY)
    assert framed is not None
    assert clear.land(framed[1], 3, payload, True) is None and plain(clear, 3) == payload
