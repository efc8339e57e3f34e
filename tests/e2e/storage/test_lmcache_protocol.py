"""The lmcache_server wire format as our client writes and reads it (no server needed; the
tests against a real server are test_lmcache_backend.py and test_contract_lmcache.py)."""

from __future__ import annotations

import struct

import pytest

from hicache.storage.backends.lmcache.protocol import (
    MAX_KEY_CHARS,
    REPLY_BYTES,
    REQUEST_BYTES,
    Command,
    ProtocolError,
    ReplyCode,
    check_name_field,
    decode_reply,
    encode_request,
    key_string,
)


def test_a_request_is_nine_int32_then_a_space_padded_key() -> None:
    key = key_string("hicache.0.tm", bytes(range(16)))
    assert key == "hicache.0.tm@1@0@000102030405060708090a0b0c0d0e0f@uint8"
    data = encode_request(Command.PUT, key, 1000)
    assert len(data) == REQUEST_BYTES == 9 * 4 + MAX_KEY_CHARS
    fields = struct.unpack("<9i", data[:36])
    # command, length, format (BINARY), dtype (uint8), location, shape [length, 0, 0, 0]
    assert fields == (1, 1000, 4, 6, 0, 1000, 0, 0, 0)
    assert data[36:].decode() == key.ljust(MAX_KEY_CHARS)
    assert struct.unpack("<i", encode_request(Command.EXIST, key)[:4]) == (3,)


def test_keys_and_values_outside_the_format_are_refused() -> None:
    with pytest.raises(ValueError, match="longer than"):
        key_string("n" * 120, bytes(16))
    with pytest.raises(ValueError, match="at most"):
        encode_request(Command.PUT, "k@1@0@0@uint8", 2**31)
    for bad in ("", "a@b", "a b", "x" * 81):
        with pytest.raises(ValueError, match="namespace"):
            check_name_field(bad, "namespace")
    assert check_name_field("tenant-a.v2", "namespace") == "tenant-a.v2"


def test_replies_are_read_and_unknown_codes_refused() -> None:
    assert REPLY_BYTES == 36
    found = decode_reply(struct.pack("<9i", 200, 4096, 4, 6, 4096, 0, 0, 0, 0))
    assert found.code is ReplyCode.SUCCESS and found.ok and found.value_bytes == 4096
    missing = decode_reply(struct.pack("<9i", 400, 0, 1, 2, 0, 0, 0, 0, 0))
    assert not missing.ok and missing.value_bytes == 0
    with pytest.raises(ProtocolError, match="unknown reply code"):
        decode_reply(struct.pack("<9i", 500, 0, 0, 0, 0, 0, 0, 0, 0))
    with pytest.raises(ProtocolError, match="negative"):
        decode_reply(struct.pack("<9i", 200, -1, 0, 0, 0, 0, 0, 0, 0))
