"""The stored-object format (frame), the page regions it is filled from, and option parsing."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import pytest
import torch
from pydantic.dataclasses import dataclass

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageError, first_gap
from hicache.storage.frame import (
    HEADER_BYTES,
    Fault,
    PayloadOrder,
    check_header,
    check_page,
    check_payload,
    checksum,
    encode_header,
    length_fault,
    object_name,
    pack_header_into,
)
from hicache.storage.options import (
    SETTINGS,
    Flag,
    FromEnv,
    Size,
    Text,
    TextOrDefault,
    must,
    number,
    parse_bool,
    parse_size,
    read_settings,
)
from hicache.storage.page_regions import PageRegions
from tests.storage_contract import fill_random, page_range

KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
ORDER = PayloadOrder.LAYER_MAJOR
GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16)
MLA_GEOMETRY = KVGeometry.mla(num_layers=3, latent_dim=12, dtype=torch.float16)


def test_a_header_checks_out_against_what_was_asked_for() -> None:
    payload: list[bytes | memoryview] = [b"abc", memoryview(b"defgh")]
    digest = checksum(payload)
    assert digest == checksum([b"abcdefgh"]) and len(digest) == 16
    header = encode_header(KEY, ORDER, 8, digest)
    assert len(header) == HEADER_BYTES == 48
    assert header[:4] == b"HCKV" and header[16:32] == KEY and header[32:] == digest
    assert check_header(header, KEY, ORDER, 8) is None
    assert check_payload(header, payload) is None
    # Written in place into a larger buffer, the same bytes.
    buffer = bytearray(HEADER_BYTES + 8)
    pack_header_into(memoryview(buffer), 8, KEY, ORDER, 8, digest)
    assert bytes(buffer[8:]) == header


@pytest.mark.parametrize(
    ("header_edit", "key", "order", "length", "fault"),
    [
        (lambda h: h[:47], KEY, ORDER, 8, Fault.SHORT_READ),
        (lambda h: b"hckv" + h[4:], KEY, ORDER, 8, Fault.BAD_MAGIC),
        (lambda h: h[:4] + b"\x02" + h[5:], KEY, ORDER, 8, Fault.BAD_VERSION),
        (lambda h: h[:6] + struct.pack("<H", 64) + h[8:], KEY, ORDER, 8, Fault.BAD_VERSION),
        (lambda h: h, KEY, PayloadOrder.TOKEN_MAJOR, 8, Fault.WRONG_ORDER),
        (lambda h: h, OTHER_KEY, ORDER, 8, Fault.WRONG_KEY),
        (lambda h: h, KEY, ORDER, 9, Fault.WRONG_LENGTH),
    ],
)
def test_each_header_mismatch_is_its_own_fault(
    header_edit: object, key: bytes, order: PayloadOrder, length: int, fault: Fault
) -> None:
    header = encode_header(KEY, ORDER, 8, checksum([b"abcdefgh"]))
    assert callable(header_edit)
    assert check_header(header_edit(header), key, order, length) is fault


def test_a_changed_payload_fails_its_checksum() -> None:
    header = encode_header(KEY, ORDER, 8, checksum([b"abcdefgh"]))
    assert check_payload(header, [b"abcdefgH"]) is Fault.CORRUPT
    assert check_payload(header, [b"abcd", memoryview(b"efgh")]) is None


def test_a_page_read_whole_is_checked_header_first_then_checksum_if_asked() -> None:
    header = encode_header(KEY, ORDER, 8, checksum([b"abcdefgh"]))
    assert check_page(header, [b"abcd", b"efgh"], KEY, ORDER, 8, True) is None
    assert check_page(header, [b"abcdefgH"], KEY, ORDER, 8, True) is Fault.CORRUPT
    # Without verification a damaged payload passes; the header is still checked.
    assert check_page(header, [b"abcdefgH"], KEY, ORDER, 8, False) is None
    assert check_page(header, [b"abcdefgH"], OTHER_KEY, ORDER, 8, True) is Fault.WRONG_KEY


def test_an_object_of_the_wrong_size_is_short_or_too_long() -> None:
    assert length_fault(55, 56) is Fault.SHORT_READ
    assert length_fault(57, 56) is Fault.WRONG_LENGTH
    assert length_fault(56, 56) is None


def test_a_stored_prefix_ends_at_the_first_gap() -> None:
    assert first_gap([True, True, False, True]) == 2
    assert first_gap([False, True]) == 0
    assert first_gap([True, True]) == 2
    assert first_gap([]) == 0


def test_object_names_carry_the_key_and_the_row_order() -> None:
    assert object_name(KEY, PayloadOrder.LAYER_MAJOR) == KEY.hex() + ".lm"
    assert object_name(KEY, PayloadOrder.TOKEN_MAJOR) == KEY.hex() + ".tm"
    assert PayloadOrder.of_layout(MemLayout.PAGE_FIRST) is PayloadOrder.TOKEN_MAJOR
    assert PayloadOrder.of_layout(MemLayout.LAYER_FIRST) is PayloadOrder.LAYER_MAJOR
    assert PayloadOrder.of_layout(MemLayout.PAGE_FIRST_DIRECT) is PayloadOrder.LAYER_MAJOR


def _payload(host: HostPool, page: int) -> bytes:
    """What the payload of ``page`` must be, from the canonical view and the layout's order."""
    canonical = host.pages[page]  # [layers, planes, page_size, row]
    if PayloadOrder.of_layout(host.layout) is PayloadOrder.TOKEN_MAJOR:
        canonical = canonical.permute(2, 0, 1, 3)  # [page_size, layers, planes, row]
    return canonical.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("geometry", [GEOMETRY, MLA_GEOMETRY], ids=["mha", "mla"])
def test_page_regions_are_the_page_in_payload_order(
    geometry: KVGeometry, layout: MemLayout
) -> None:
    host = HostPool(geometry, 5, 4, layout, pin_memory=False)
    fill_random(host, page_range(0, 5), seed=1)
    regions = PageRegions(host)
    planes = geometry.kv_planes
    expected_regions = 1 if layout is not MemLayout.LAYER_FIRST else planes * geometry.num_layers
    assert regions.num_regions == expected_regions
    assert regions.page_bytes == host.page_bytes
    for page in range(5):
        views = regions.views(page)
        assert b"".join(bytes(v) for v in views) == _payload(host, page)
        assert [a - host.flat.data_ptr() for a in regions.addresses(page)] == regions.offsets(
            page
        )
    # The views are the pool's memory: writing through them changes the page.
    before = host.pages[2].clone()
    for view in regions.views(2):
        view[:] = bytes(len(view))
    assert torch.count_nonzero(host.pages[2]) == 0
    assert torch.count_nonzero(before) > 0
    assert torch.count_nonzero(host.pages[1]) > 0 and torch.count_nonzero(host.pages[3]) > 0


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_payload_is_copied_into_and_out_of_a_page(layout: MemLayout) -> None:
    host = HostPool(GEOMETRY, 4, 4, layout, pin_memory=False)
    fill_random(host, page_range(0, 4), seed=2)
    regions = PageRegions(host)
    payload = _payload(host, 1)
    # Out into a longer buffer (a store's block with room for the header after the payload).
    block = bytearray(len(payload) + HEADER_BYTES)
    regions.copy_out(1, memoryview(block))
    assert bytes(block[: len(payload)]) == payload and not any(block[len(payload) :])
    # In, from a longer buffer: only page 3 changes, and it becomes page 1.
    others = [host.pages[p].clone() for p in (0, 1, 2)]
    regions.copy_in(3, memoryview(block))
    assert _payload(host, 3) == payload
    for page, before in zip((0, 1, 2), others, strict=True):
        assert torch.equal(host.pages[page], before)


@dataclass(frozen=True, config=SETTINGS)
class ExampleSettings:
    flag: Flag = False
    n: Annotated[float, number()] = 1.0
    c: Annotated[int, number(1, whole=True)] = 4
    size: Annotated[Size, FromEnv("HICACHE_TEST_SIZE", "HICACHE_TEST_SIZE_2")] = 7
    word: Text = "d"
    near: Annotated[
        TextOrDefault, must(lambda near: near != "far", "must not be far"),
        FromEnv("HICACHE_TEST_NEAR", name_variable=False),
    ] = "x"


def read(**extra: object) -> ExampleSettings:
    return read_settings(ExampleSettings, extra, "test store")


def test_sizes_and_options_are_read_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_size(123) == 123
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5k") == 1500
    assert parse_size("2Ki") == 2048
    for bad in ("16 parsecs", -1, True, 1.5, "GB", "1PB"):
        with pytest.raises(ValueError, match="must be"):
            parse_size(bad)
    with pytest.raises(StorageError, match="test store: flag must be true or false"):
        read(flag="yes")
    with pytest.raises(StorageError, match="test store: n must be a number >= 0"):
        read(n=-1.0)
    with pytest.raises(StorageError, match="test store: size must be a size in bytes"):
        read(size="lots")
    with pytest.raises(StorageError, match="test store: word must be a string, got 3"):
        read(word=3)
    with pytest.raises(StorageError, match=r"unknown extra-config key\(s\) sise, z; known keys: "
                                           "c, flag, n, near, size, word"):
        read(sise=1, z=None, n=2)
    monkeypatch.setenv("HICACHE_TEST_SIZE_2", "2KiB")
    settings = read(word="", near="", n=None)
    assert (settings.size, settings.word, settings.near, settings.n) == (2048, "", "x", 1.0)
    assert read(size=5).size == 5  # the extra config wins


def test_counts_flags_and_where_a_value_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read(c=3.0, flag=" True ").c == 3
    assert read().c == 4
    with pytest.raises(StorageError, match=r"test store: c must be a whole number, got 2\.5"):
        read(c=2.5)
    with pytest.raises(StorageError, match="test store: c must be a number >= 1"):
        read(c=0)
    assert read(flag=" True ").flag is True
    assert parse_bool("0") is False and parse_bool(True) is True
    with pytest.raises(ValueError, match="must be true or false"):
        parse_bool(1)
    monkeypatch.setenv("HICACHE_TEST_SIZE", "2 parsecs")
    with pytest.raises(StorageError, match="test store: environment variable HICACHE_TEST_SIZE "
                                           "must be a size in bytes"):
        read()
    with pytest.raises(StorageError, match="test store: size must be >= 0 bytes"):
        read(size=-1)
    monkeypatch.setenv("HICACHE_TEST_NEAR", "  ")
    assert read(size=1).near == "  "
    monkeypatch.setenv("HICACHE_TEST_NEAR", "far")  # this field's errors name the key
    with pytest.raises(StorageError, match=r"^test store: near must not be far$"):
        read(size=1)


# Regions of 16 tokens x 8 KV heads x 64 (bf16): 16 KiB each, 16 of them a page (256 KiB):
# above xxhash's threshold for hashing without the GIL, in regions below it.
SMALL_REGIONS = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_page_of_small_regions_is_hashed_whole_with_the_same_checksum(
    layout: MemLayout,
) -> None:
    host = HostPool(SMALL_REGIONS, 6, 16, layout, pin_memory=False)
    fill_random(host, page_range(0, 6), seed=3)
    regions = PageRegions(host)
    # Only layer_first pages come in regions; page_first ones are one region, hashed whole.
    assert regions.gathers_to_hash == (layout is MemLayout.LAYER_FIRST)
    for page in range(6):
        assert regions.hash_page(page) == checksum([_payload(host, page)])
        assert regions.checksum(page) == checksum([_payload(host, page)])
    # Pages of the tiny geometry (a few hundred bytes) are hashed in place.
    assert not PageRegions(HostPool(GEOMETRY, 2, 4, layout, pin_memory=False)).gathers_to_hash


def test_a_gathered_hash_finds_one_changed_byte_in_any_region() -> None:
    host = HostPool(SMALL_REGIONS, 3, 16, MemLayout.LAYER_FIRST, pin_memory=False)
    fill_random(host, page_range(0, 3), seed=4)
    regions = PageRegions(host)
    header = encode_header(KEY, regions.order, regions.page_bytes, regions.hash_page(1))
    assert regions.check_landed(header, 1, verify_checksum=True) is None
    last = regions.views(1)[-1]
    last[-1] = (last[-1] + 1) % 256
    assert regions.check_landed(header, 1, verify_checksum=True) is Fault.CORRUPT


def test_threads_hash_pages_side_by_side_each_in_its_own_staging() -> None:
    host = HostPool(SMALL_REGIONS, 16, 16, MemLayout.LAYER_FIRST, pin_memory=False)
    fill_random(host, page_range(0, 16), seed=5)
    regions = PageRegions(host)
    expected = [checksum([_payload(host, page)]) for page in range(16)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(5):
            assert list(pool.map(regions.hash_page, range(16))) == expected


def test_a_gathered_page_is_hashed_in_one_call_large_enough_to_release_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hicache.storage import page_regions

    host = HostPool(SMALL_REGIONS, 2, 16, MemLayout.LAYER_FIRST, pin_memory=False)
    fill_random(host, page_range(0, 2), seed=6)
    regions = PageRegions(host)
    calls: list[list[int]] = []

    def recording(fragments: list[memoryview]) -> bytes:
        calls.append([len(memoryview(f).cast("B")) for f in fragments])
        return checksum(fragments)

    monkeypatch.setattr(page_regions, "checksum", recording)
    regions.hash_page(1)
    assert calls == [[regions.page_bytes]]
    assert regions.page_bytes > page_regions.GIL_FREE_HASH_BYTES >= regions.region_bytes
