"""Page hashes and event batches as SGLang-reading routers expect them."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest

from hicache.events.hashing import packed_page_digests, page_digests, page_hashes
from hicache.events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_sequence,
    encode_batch,
    encode_sequence,
)


def _reference_hashes(tokens: list[int], page: int) -> list[int]:
    # Written from the scheme's description, independently of the module: the
    # hex digest's first 16 characters as an unsigned value, folded to int64.
    out, parent = [], b""
    for start in range(0, len(tokens) // page * page, page):
        data = parent + b"".join(struct.pack("<I", t) for t in tokens[start:start + page])
        parent = hashlib.sha256(data).digest()
        value = int(parent.hex()[:16], 16)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_hashes_follow_the_published_scheme(page: int) -> None:
    tokens = [0, 1, 49151, 2**31, 7, 7, 7, 123456] * 5 + [9]
    assert page_hashes(tokens, page) == _reference_hashes(tokens, page)


def test_a_page_hash_names_its_whole_prefix() -> None:
    a = page_hashes([1, 2, 3, 4, 5, 6], 2)
    b = page_hashes([9, 9, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7], 2) == a  # a partial page is not hashed
    assert page_hashes([1], 2) == []
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)


def test_batches_are_tagged_positional_arrays() -> None:
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU"),
            BlockRemoved([11], "CPU_PINNED"),
            AllBlocksCleared(),
        ],
        attn_dp_rank=0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        12.5,
        [
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
            ["BlockRemoved", [11], "CPU_PINNED"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_a_batch_without_medium_decodes() -> None:
    # Older SGLang workers send BlockStored without the medium field.
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [5], 4, [1], 1, None]]])
    event = decode_batch(payload).events[0]
    assert isinstance(event, BlockStored) and event.medium is None and event.parent_block_hash == 4


def test_malformed_payloads_raise_value_errors() -> None:
    for payload in (b"\xc1", msgspec.msgpack.encode([1.0, [["Nope", 1]]]), b""):
        with pytest.raises(ValueError):
            decode_batch(payload)


def test_sequence_numbers_are_eight_signed_big_endian_bytes() -> None:
    assert encode_sequence(1) == b"\x00" * 7 + b"\x01"
    assert decode_sequence(encode_sequence(-1)) == -1
    assert decode_sequence(encode_sequence(2**40 + 3)) == 2**40 + 3
    with pytest.raises(ValueError):
        decode_sequence(b"\x00")


@pytest.mark.parametrize("tokens", [[-1, 2], [2**32, 1], [1.5, 2]])
def test_token_ids_outside_four_bytes_are_refused(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        page_hashes(tokens, 2)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_packed_tokens_hash_as_the_token_list_does(page: int) -> None:
    tokens = [0, 1, 49151, 2**31 - 1, 7, 7, 7, 123456] * 5 + [9]
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    parent = hashlib.sha256(b"parent").digest()
    assert packed_page_digests(packed, page, parent) == page_digests(tokens, page, parent)
    assert packed_page_digests(packed, page) == page_digests(tokens, page)
