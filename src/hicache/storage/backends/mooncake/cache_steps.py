"""Sizing L3 copies so that a page is hashed while it is still in the CPU's last-level cache.

A page a backend stores is hashed for its frame checksum unless the cache took
that checksum already (``memory.page_digests``: it does while copying a page in
from a CPU device), and a page it reads is hashed again to verify it unless the
cache's load verifies it (again with a CPU device). When the backend hashes:
xxh3 hashes about 85 GB/s from cache but only at DRAM speed (~35 GB/s on a
2-vCPU EPYC) from memory, and a hash pass from DRAM also competes with the
store's own copy for memory bandwidth. So the Mooncake backend then moves a
batch in *cache steps*: a few pages at a time, hashing each step while its
bytes are in the last-level cache:

- put: the helper thread hashes step k+1 (one DRAM read that leaves it in
  the cache) while Mooncake copies step k, which it then reads from cache;
- get: Mooncake copies step k+1 while the helper verifies step k, which the
  copy has just written (still in cache).

A step is half the cache: while the helper hashes one step, Mooncake's copy
of the other streams through the cache a little at a time. Each Mooncake call
has a fixed cost (master RPCs, a thread hand-off), so steps of a page or less
lost to it; on a 32 MiB L3, 16 and 32 MiB steps measured alike and 64 MiB
worse. The second condition is that a copy leaves its destination in the
cache at all: memcpy switches to non-temporal stores (which bypass the cache)
above a size of the order of a megabyte, so the copy is handed to Mooncake in
pieces of ``COPY_PIECE_BYTES`` (its multi-buffer calls take any split of an
object into buffers; each piece is one memcpy of cacheable stores).
"""

from __future__ import annotations

from pathlib import Path

# When the cache cannot be read from sysfs: an AMD EPYC CCX's L3 (a common case
# and, being large, a step that still amortises the per-call cost).
FALLBACK_CACHE_BYTES = 32 * 2**20
# Pieces a page's copy is split into: below glibc's non-temporal threshold on
# the machines we measured (a 4 MiB memcpy left its destination uncached, a
# 512 KiB one did not), large enough that the per-piece cost is negligible.
COPY_PIECE_BYTES = 256 * 2**10
_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache ``size`` ("32768K", "1M", "512")."""
    text = text.strip()
    if not text:
        raise ValueError("empty cache size")
    unit = _UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit is not None else int(text)


def last_level_cache_bytes(caches: Path = _CPU_CACHES) -> int:
    """Size of the highest-level data (or unified) cache of CPU 0; a fallback when unknown."""
    best_level, best_bytes = 0, 0
    try:
        entries = sorted(caches.glob("index*"))
        for entry in entries:
            if (entry / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            level = int((entry / "level").read_text())
            size = parse_cache_size((entry / "size").read_text())
            if level > best_level:
                best_level, best_bytes = level, size
    except (OSError, ValueError):
        return FALLBACK_CACHE_BYTES
    return best_bytes if best_bytes > 0 else FALLBACK_CACHE_BYTES


def cache_step_bytes(cache_bytes: int) -> int:
    """Bytes one step of a batch should move: half the cache (see the module doc)."""
    return max(1, cache_bytes // 2)


def copy_pieces(
    addresses: list[int], region_bytes: int, piece_bytes: int = COPY_PIECE_BYTES
) -> tuple[list[int], list[int]]:
    """The regions at ``addresses`` (``region_bytes`` each) cut into pieces of at most
    ``piece_bytes``, in order: their concatenation is the same bytes. Returns the pieces'
    addresses and sizes."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    starts: list[int] = []
    sizes: list[int] = []
    for address in addresses:
        for offset in range(0, region_bytes, piece_bytes):
            starts.append(address + offset)
            sizes.append(min(piece_bytes, region_bytes - offset))
    return starts, sizes
