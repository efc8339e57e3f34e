"""Page hashes a router can compute from a request's token ids.

SGLang's published scheme, so routers that read SGLang workers read ours: each
full page hashes SHA-256 over its parent page's whole digest (nothing for the
first page) followed by each token id as 4 little-endian bytes; the event
carries the digest's first 8 bytes read as a big-endian signed int64. Chaining
through the parent makes a page's hash name its whole prefix, so equal hashes
mean equal prefixes (up to SHA-256 collisions), whatever worker computed them.

Tenants: the default tenant's pages (``extra_key`` None) hash exactly as SGLang's,
so its router keeps working for untenanted traffic. Every other tenant's first
page chains from ``tenant_root_digest(extra_key)`` instead of nothing, so the
same tokens of two tenants never share a hash, and a router that hashes with the
request's tenant (``hicache router``) never scores one tenant's pages as another's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

TOKEN_BYTES = 4


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers, in one call (a
    router hashes every prompt: packing per token costs ~15x more)."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as error:
        raise ValueError(f"token ids must be integers in [0, 2^32): {error}") from None


def _digest(page: bytes, parent_digest: bytes | None) -> bytes:
    hasher = hashlib.sha256()
    if parent_digest is not None:
        hasher.update(parent_digest)
    hasher.update(page)
    return hasher.digest()


def tenant_root_digest(extra_key: str | None) -> bytes | None:
    """The digest a tenant's first page chains from: None (nothing, as SGLang) for the
    default tenant, else a SHA-256 of the tenant's extra key, domain-separated from page
    digests (those hash whole pages of 4-byte tokens, never this prefix)."""
    if extra_key is None:
        return None
    return hashlib.sha256(
        b"hicache-tenant\x00" + extra_key.encode("utf-8", "surrogatepass")).digest()


def digest_to_hash(digest: bytes) -> int:
    """The int64 a KV event carries for a page digest."""
    return int.from_bytes(digest[:8], "big", signed=True)


def page_digests(
    token_ids: Sequence[int], page_size: int, parent_digest: bytes | None = None,
) -> list[bytes]:
    """Digests of every full page of ``token_ids`` (a partial tail page has none:
    only full pages are cached and announced)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    num_tokens = len(token_ids) // page_size * page_size
    data = token_bytes(token_ids[:num_tokens])
    step = page_size * TOKEN_BYTES
    digests: list[bytes] = []
    parent = parent_digest
    for start in range(0, len(data), step):
        parent = _digest(data[start:start + step], parent)
        digests.append(parent)
    return digests


def page_hashes(
    token_ids: Sequence[int], page_size: int, parent_digest: bytes | None = None,
) -> list[int]:
    """The int64 hashes of every full page of ``token_ids``, chained from
    ``parent_digest`` (None: the pages start at the root)."""
    return [digest_to_hash(d) for d in page_digests(token_ids, page_size, parent_digest)]


def packed_page_digests(
    token_bytes: bytes, page_size: int, parent_digest: bytes | None = None,
) -> list[bytes]:
    """``page_digests`` of tokens already packed as little-endian int32 (the radix
    tree's representation, which is the scheme's per-token encoding for ids below
    2^31): one hash update per page, no per-token conversion."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    step = page_size * 4
    digests: list[bytes] = []
    parent = parent_digest
    for start in range(0, len(token_bytes) - step + 1, step):
        hasher = hashlib.sha256()
        if parent is not None:
            hasher.update(parent)
        hasher.update(token_bytes[start:start + step])
        parent = hasher.digest()
        digests.append(parent)
    return digests
