"""The ``lmcache_server`` wire format: fixed-size little-endian messages over one TCP stream.

LMCache's standalone cache server (``lmcache_server HOST PORT cpu``) keeps
byte blobs in a dictionary in its memory. A client sends requests; every
request is a 186-byte header, a PUT's header is followed by its value::

    offset  bytes  field (request)
         0      4  command: 1 PUT, 2 GET, 3 EXIST, 5 HEALTH (int32, like every field)
         4      4  value length in bytes (PUT; 0 otherwise)
         8      4  memory format (we send 4, LMCache's BINARY)
        12      4  dtype code (we send 6, uint8)
        16      4  location (0: none)
        20     16  shape, four int32 (we send [length, 0, 0, 0])
        36    150  key string, ASCII, padded with spaces

The server answers GET, EXIST and HEALTH (never PUT) with a 36-byte reply,
followed for a successful GET by the value's bytes::

    offset  bytes  field (reply)
         0      4  code: 200 success (found / healthy), 400 fail (missing)
         4      4  value length (GET: as its PUT declared it)
         8     20  format, dtype, shape: echoed from the PUT, unused here
        28      4  location

A connection's requests are served one at a time in order, so a client may
send many requests before reading any reply (pipelining): replies come back
in request order, and a reply to a later request means every earlier PUT on
that connection is stored. The server runs one thread per connection.

The key must parse as an LMCache ``CacheEngineKey``,
``model@world_size@worker_id@chunk_hash_hex@dtype``; the server closes the
connection on a key it cannot parse. A PUT replaces any value stored under
its key. There is no DELETE, LIST or eviction: the server's memory only grows
until it is restarted.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum

MAX_KEY_CHARS = 150
REQUEST = struct.Struct(f"<9i{MAX_KEY_CHARS}s")
REPLY = struct.Struct("<9i")
REQUEST_BYTES = REQUEST.size
REPLY_BYTES = REPLY.size
assert (REQUEST_BYTES, REPLY_BYTES) == (186, 36)
# Values are sized by an int32.
MAX_VALUE_BYTES = 2**31 - 1
_BINARY_FORMAT = 4  # LMCache's MemoryFormat.BINARY
_UINT8_DTYPE = 6  # LMCache's dtype code of torch.uint8
# What a name field of a key may hold: no "@" (the field separator), no spaces.
_NAME_FIELD = re.compile(r"^[A-Za-z0-9._:+-]+$")


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    HEALTH = 5


class ReplyCode(IntEnum):
    SUCCESS = 200
    FAIL = 400


class ProtocolError(Exception):
    """The server answered something this client cannot read (not one of its replies)."""


@dataclass(frozen=True)
class Reply:
    code: ReplyCode
    value_bytes: int

    @property
    def ok(self) -> bool:
        return self.code is ReplyCode.SUCCESS


def check_name_field(name: str, where: str) -> str:
    """``name`` if it fits the model-name field of a key; ValueError naming ``where``."""
    if not _NAME_FIELD.match(name) or len(name) > 80:
        raise ValueError(
            f"{where} must be 1-80 characters of letters, digits and . _ : + -, got {name!r}"
        )
    return name


def key_string(name: str, digest: bytes) -> str:
    """The LMCache key of object ``digest`` (up to 64 bytes) under model name ``name``.

    The digest travels as the chunk hash (hex); world size 1, worker 0, dtype uint8.
    """
    key = f"{name}@1@0@{digest.hex() or '0'}@uint8"
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"key {key!r} is longer than {MAX_KEY_CHARS} characters")
    return key


def encode_request(command: Command, key: str, value_bytes: int = 0) -> bytes:
    """A request header; a PUT's ``value_bytes`` of value must follow it."""
    if not 0 <= value_bytes <= MAX_VALUE_BYTES:
        raise ValueError(f"a value holds at most {MAX_VALUE_BYTES} bytes, got {value_bytes}")
    encoded = key.encode("ascii")
    if len(encoded) > MAX_KEY_CHARS:
        raise ValueError(f"key {key!r} is longer than {MAX_KEY_CHARS} characters")
    return REQUEST.pack(
        int(command), value_bytes, _BINARY_FORMAT, _UINT8_DTYPE, 0, value_bytes, 0, 0, 0,
        encoded.ljust(MAX_KEY_CHARS, b" "),
    )


def decode_reply(data: bytes | bytearray | memoryview) -> Reply:
    code, value_bytes = REPLY.unpack_from(data)[:2]
    try:
        reply_code = ReplyCode(code)
    except ValueError:
        raise ProtocolError(f"unknown reply code {code} from lmcache_server") from None
    if value_bytes < 0:
        raise ProtocolError(f"negative value length {value_bytes} from lmcache_server")
    return Reply(reply_code, value_bytes if reply_code is ReplyCode.SUCCESS else 0)
