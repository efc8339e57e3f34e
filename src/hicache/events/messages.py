"""KV event messages in SGLang's (and vLLM's) wire format.

A batch travels as one ZMQ multipart message: topic, an 8-byte big-endian
sequence number, and the msgpack encoding of a :class:`KVEventBatch`. Structs
are array-like (positional fields, trailing defaults omitted) and events are
tagged with their class name, which is what those routers' decoders expect.

``BlockPinned`` is ours (pages pinned or unpinned on a tier, so that a router can count
a pinned page as a sure hit): SGLang's decoder knows no such tag and would refuse the
whole batch, so a worker sends it only when its config asks (``pin_events``).
"""

from __future__ import annotations

from typing import Final

import msgspec

# Media a page can live in, one per tier (Dynamo's table of KV event media).
MEDIUM_GPU: Final = "GPU"  # L1, the device pool (whatever the device is)
MEDIUM_CPU: Final = "CPU_PINNED"  # L2, the host pool
MEDIUM_EXTERNAL: Final = "EXTERNAL"  # L3, the shared storage
MEDIA: Final = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_EXTERNAL)


class KVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True,
):
    """Base of the events a batch carries."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class BlockPinned(KVCacheEvent):
    """``block_hashes`` were pinned (``pinned``) or unpinned in ``medium``: a pinned
    page is not evicted from that tier until unpinned or its TTL ends."""

    block_hashes: list[int]
    pinned: bool
    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | BlockPinned


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    attn_dp_rank: int | None = None


SEQUENCE_BYTES: Final = 8
# The replay socket ends its answer with this sequence number and an empty payload.
REPLAY_END_SEQUENCE: Final = -1

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises ``msgspec.DecodeError`` (a ``ValueError``) on
    anything that is not a well-formed batch."""
    return _decoder.decode(payload)


def encode_sequence(sequence: int) -> bytes:
    return sequence.to_bytes(SEQUENCE_BYTES, "big", signed=True)


def decode_sequence(raw: bytes) -> int:
    if len(raw) != SEQUENCE_BYTES:
        raise ValueError(f"a sequence number is {SEQUENCE_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)
