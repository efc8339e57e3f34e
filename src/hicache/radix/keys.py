"""Chained 128-bit page keys, namespaced so that caches never cross models or tenants.

key(page i) = xxh3_128(key(page i-1) || tokens of page i), with key(page -1) the
namespace seed. The seed hashes the model identity, KV geometry and dtype, page
size, the tensor-parallel layout and an optional per-request extra key (cache
salt). A page key therefore names the whole prefix up to and including that
page in that namespace: equal keys mean equal prefixes (up to 2^-128
collisions), in every process, which is what lets instances share L3 pages.

Tokens are packed as little-endian int32 (``pack_tokens``), the same bytes the
radix tree stores, so keys can be computed from a node without conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

KEY_BYTES = 16
TOKEN_BYTES = 4  # token ids are stored as int32


class PackedTokens(bytes):
    """Token ids already packed by ``pack_tokens``, which passes them through as they are:
    a waiting request's tokens are looked up in the tree several times a step, and
    packing a long prompt's list each time showed up in the scheduler thread's profile."""

    @property
    def num_tokens(self) -> int:
        return len(self) // TOKEN_BYTES


TokenIds = Sequence[int] | npt.NDArray[np.integer] | PackedTokens


def num_tokens(tokens: TokenIds) -> int:
    """How many token ids ``tokens`` holds (packed or not)."""
    return tokens.num_tokens if isinstance(tokens, PackedTokens) else len(tokens)


def pack_tokens(tokens: TokenIds) -> bytes:
    """Token ids as little-endian int32 bytes (the tree's and the keys' representation)."""
    if isinstance(tokens, PackedTokens):
        return tokens
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2^31)")
    return array.astype("<i4", copy=False).tobytes()


def unpack_tokens(data: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(data, dtype="<i4")


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that makes the same tokens produce different KV."""

    model: str
    kv_layout: str  # e.g. KVGeometry.describe(): layers, heads, head dim, dtype
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1

    def seed(self, extra_key: str | None = None) -> bytes:
        """The chain seed for this namespace and an optional cache salt."""
        text = (
            f"hicache-v1|model={self.model}|kv={self.kv_layout}|page={self.page_size}"
            f"|tp={self.tp_rank}/{self.tp_size}|extra={'' if extra_key is None else extra_key}"
        )
        # A None extra key and an empty one must differ: length-prefix the salt.
        if extra_key is not None:
            text += f"|len={len(extra_key)}"
        return xxhash.xxh3_128_digest(text.encode())


def chain_page_keys(token_bytes: bytes, page_size: int, prev_key: bytes) -> list[bytes]:
    """Keys of each full page of ``token_bytes``, chained from ``prev_key``.

    ``token_bytes`` must hold a whole number of pages (``pack_tokens`` output).
    """
    step = page_size * TOKEN_BYTES
    if len(token_bytes) % step:
        raise ValueError(
            f"{len(token_bytes) // TOKEN_BYTES} tokens is not a multiple of page size {page_size}"
        )
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    key = prev_key
    for start in range(0, len(token_bytes), step):
        key = digest(key + token_bytes[start : start + step])
        keys.append(key)
    return keys
