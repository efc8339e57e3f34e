"""The on-store object format: a 48-byte header stored with every page.

Every L3 object is ``payload || header``: the payload first keeps it aligned
where it is stored (a file's first byte, a Mooncake object's start), which
copies measurably faster than a payload at offset 48. The payload is the
page's KV bytes as the host pool holds them and the header (little-endian) is::

    offset  bytes  field
         0      4  magic b"HCKV"
         4      1  format version (1)
         5      1  payload order (PayloadOrder: how the page's rows are laid out)
         6      2  header bytes (48; lets a later version grow the header)
         8      8  payload bytes
        16     16  the page key (radix.keys)
        32     16  xxh3_128 of the payload

A reader checks every field against what it asked for (``check_header``) and
the checksum against the bytes it received (``check_payload``). Any mismatch
is a ``Fault``: the page is a miss, counted under the fault's name, and the
object is dropped from the store. The key in the header catches objects
stored under the wrong name (a bug or a hash-prefix collision in a shared
store); the length catches truncation; the checksum catches corruption.

Two host layouts store a page's rows in different orders (page_first is
token-major, layer_first and page_first_direct are layer-major). The order is
part of both the header and the object name, so instances that use different
layouts never read each other's pages as garbage; they simply do not share.
Sealed pages (``--l3-encryption-keys``, ``storage.sealing``) use format version 2:
the payload is the page's AES-256-GCM ciphertext (same length), and the header
is 64 bytes, the first 48 laid out as above with the GCM tag in place of the
checksum (authenticated encryption replaces it), then::

        48     12  the nonce (random per page)
        60      4  the key id (``tenancy.keys``) that sealed it

The associated data is the whole header but the tag (``sealed_aad``), so the page
key, row order and length are authenticated with the payload: an object moved
to another page's name, or sealed under another key, fails the tag. An instance
reads only its own version (sealed, or plain): the other is a ``BAD_VERSION``
fault, a miss.

The geometry (MHA K and V, or one MLA latent per layer) is not in the header:
it is in the page key's namespace (``KVGeometry.describe``), so an MLA page and
an MHA page never share a key; the payload length double-checks it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from enum import Enum, IntEnum

import xxhash

from hicache.config import MemLayout
from hicache.storage.base import PAGE_KEY_BYTES

MAGIC = b"HCKV"
FORMAT_VERSION = 1
SEALED_FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sBBHQ16s16s")
HEADER_BYTES = _HEADER.size
CHECKSUM_BYTES = 16
assert HEADER_BYTES == 48
# The sealed header: the plain one's fields (tag for checksum), then nonce and key id.
_SEALED = struct.Struct("<4sBBHQ16s16s12sI")
SEALED_HEADER_BYTES = _SEALED.size
TAG_BYTES = 16
NONCE_BYTES = 12
_TAG_AT = 32
assert SEALED_HEADER_BYTES == 64

# Anything that exposes the buffer protocol (bytes, bytearray, memoryview of a page).
Buffer = bytes | bytearray | memoryview


class PayloadOrder(IntEnum):
    """How the rows of one page follow each other in the payload."""

    # A plane is K or V; an MLA page has one plane (the latent) per layer.
    LAYER_MAJOR = 1  # [layers][planes][page_size][row]: layer_first, page_first_direct
    TOKEN_MAJOR = 2  # [page_size][layers][planes][row]: page_first

    @classmethod
    def of_layout(cls, layout: MemLayout) -> PayloadOrder:
        return cls.TOKEN_MAJOR if layout is MemLayout.PAGE_FIRST else cls.LAYER_MAJOR

    @property
    def tag(self) -> str:
        """Suffix of object names ("lm" / "tm")."""
        return "lm" if self is PayloadOrder.LAYER_MAJOR else "tm"

    @classmethod
    def of_tag(cls, tag: str) -> PayloadOrder:
        """The order an object-name suffix stands for (a worker's
        ``hicache_l3_object_order`` in /get_server_info)."""
        for order in cls:
            if order.tag == tag:
                return order
        raise ValueError(f"unknown payload order tag {tag!r}: expected lm or tm")


class Fault(str, Enum):
    """Why a stored object was rejected on read (the failure reason in stats)."""

    SHORT_READ = "short_read"  # fewer bytes than header + payload
    BAD_MAGIC = "bad_magic"  # not one of our objects, or its first bytes are damaged
    BAD_VERSION = "bad_version"  # written by an incompatible format version
    WRONG_ORDER = "wrong_order"  # written from a host layout with another row order
    WRONG_KEY = "wrong_key"  # the header names another page
    WRONG_LENGTH = "wrong_length"  # payload length differs from this pool's page size
    CORRUPT = "corrupt"  # payload checksum mismatch
    UNKNOWN_KEY = "unknown_key"  # sealed under a key id the key file has not (for its tenant)
    BAD_TAG = "bad_tag"  # a sealed page that fails authentication (damaged, moved, wrong key)


def object_name(key: bytes, order: PayloadOrder) -> str:
    """Store name of a page: hex key plus row-order tag, e.g. ``0f1e...9a.tm``.

    The Mooncake backend names its objects so, and the file backend its files
    (under a directory named by the first two characters). A router that asks
    the shared store which of a request's pages it holds computes the keys with
    ``radix.keys.chain_page_keys`` from the worker's ``hicache_l3_key_seed`` and
    names them with this and the worker's ``hicache_l3_object_order``.
    """
    return f"{key.hex()}.{order.tag}"


def checksum(fragments: Iterable[Buffer]) -> bytes:
    """xxh3_128 of the concatenated fragments (a page's payload, in payload order)."""
    hasher = xxhash.xxh3_128()
    for fragment in fragments:
        hasher.update(fragment)
    return hasher.digest()


def encode_header(key: bytes, order: PayloadOrder, payload_bytes: int, digest: bytes) -> bytes:
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, int(order), HEADER_BYTES, payload_bytes, key, digest
    )


def pack_header_into(
    buffer: memoryview, offset: int, key: bytes, order: PayloadOrder, payload_bytes: int,
    digest: bytes,
) -> None:
    """Write a header straight into a (registered) buffer: no temporary bytes object."""
    _HEADER.pack_into(
        buffer, offset, MAGIC, FORMAT_VERSION, int(order), HEADER_BYTES, payload_bytes, key,
        digest,
    )


def header_bytes(sealed: bool) -> int:
    """Bytes of the header an instance writes and reads (sealed or plain)."""
    return SEALED_HEADER_BYTES if sealed else HEADER_BYTES


def encode_sealed_header(
    key: bytes, order: PayloadOrder, payload_bytes: int, nonce: bytes, key_id: int
) -> bytearray:
    """A sealed header with a zero tag (the seal fills it in: ``set_tag``)."""
    return bytearray(_SEALED.pack(
        MAGIC, SEALED_FORMAT_VERSION, int(order), SEALED_HEADER_BYTES, payload_bytes, key,
        bytes(TAG_BYTES), nonce, key_id,
    ))


def sealed_aad(header: Buffer) -> bytes:
    """The associated data of a sealed page: its header without the tag."""
    view = memoryview(header)
    return bytes(view[:_TAG_AT]) + bytes(view[_TAG_AT + TAG_BYTES : SEALED_HEADER_BYTES])


def set_tag(header: bytearray, tag: bytes) -> None:
    header[_TAG_AT : _TAG_AT + TAG_BYTES] = tag


def sealed_fields(header: Buffer) -> tuple[bytes, bytes, int]:
    """(tag, nonce, key id) of a (checked) sealed header."""
    fields = _SEALED.unpack_from(header)
    return fields[6], fields[7], fields[8]


def check_header(
    header: Buffer, key: bytes, order: PayloadOrder, payload_bytes: int, sealed: bool = False
) -> Fault | None:
    """The fault in ``header`` for page ``key`` of ``payload_bytes`` bytes, or None.
    ``sealed``: the header must be a sealed one (version 2), else a plain one."""
    expected_bytes = header_bytes(sealed)
    if len(header) < expected_bytes:
        return Fault.SHORT_READ
    magic, version, got_order, got_header_bytes, got_bytes, got_key, _ = (
        _HEADER.unpack_from(header)
    )
    if magic != MAGIC:
        return Fault.BAD_MAGIC
    expected_version = SEALED_FORMAT_VERSION if sealed else FORMAT_VERSION
    if version != expected_version or got_header_bytes != expected_bytes:
        return Fault.BAD_VERSION
    if got_order != order:
        return Fault.WRONG_ORDER
    if len(got_key) != PAGE_KEY_BYTES or got_key != key:
        return Fault.WRONG_KEY
    if got_bytes != payload_bytes:
        return Fault.WRONG_LENGTH
    return None


def header_checksum(header: Buffer) -> bytes:
    """The payload checksum a (checked) header carries."""
    digest: bytes = _HEADER.unpack_from(header)[6]
    return digest


def check_payload(header: Buffer, fragments: Iterable[Buffer]) -> Fault | None:
    """CORRUPT when the payload does not hash to the header's checksum."""
    return None if checksum(fragments) == header_checksum(header) else Fault.CORRUPT


def length_fault(object_bytes: int, expected_bytes: int) -> Fault | None:
    """SHORT_READ or WRONG_LENGTH when a stored object is not ``expected_bytes`` long.

    Backends that learn an object's size before (or instead of) reading it check
    this first: a longer object has trailing bytes, so it is not one we wrote.
    """
    if object_bytes < expected_bytes:
        return Fault.SHORT_READ
    if object_bytes > expected_bytes:
        return Fault.WRONG_LENGTH
    return None


def check_page(
    header: Buffer, payload: Iterable[Buffer], key: bytes, order: PayloadOrder,
    payload_bytes: int, verify_checksum: bool,
) -> Fault | None:
    """The fault of a page read back whole (``payload`` its fragments in payload order):
    the header's, then, when ``verify_checksum``, the payload's. None if it is good."""
    fault = check_header(header, key, order, payload_bytes)
    if fault is None and verify_checksum:
        fault = check_payload(header, payload)
    return fault
