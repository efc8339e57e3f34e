"""The aibrix backend's options, and the ``AIBRIX_KV_CACHE_OL_*`` environment they become.

AIBrix KVCache reads its whole configuration from environment variables when
a cache manager is built. Our extra-config keys are the few that matter for
an L3 tier; each falls back to the AIBrix variable of the same meaning (so a
deployment already configured for AIBrix keeps its settings), the extra config
winning. ``environment`` then renders the full set of variables a manager is
built under, including the ones we fix because the backend relies on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hicache.local_cache import local_cache_dir
from hicache.storage.base import StorageError
from hicache.storage.options import Options, parse_bool, parse_size

# Our key -> the AIBrix variable it falls back to.
ENV = {
    "path": "AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT",
    "l1": "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED",
    "l1_capacity": "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB",
    "l1_eviction_policy": "AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY",
    "l2": "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND",
    "ttl_s": "AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S",
}
KNOWN_KEYS = {*ENV, "verify_checksum"}
EVICTION_POLICIES = ("S3FIFO", "LRU", "FIFO")
# AIBrix's own default is 10 GB of host memory; an L3 tier beside our host pool
# (itself the L2) should not take that much unasked.
DEFAULT_L1_CAPACITY_BYTES = 2**30
# AIBrix's default: RocksDB drops a page at its first compaction past this age.
# That TTL is AIBrix's only bound on the RocksDB store's size.
DEFAULT_TTL_S = 600

# Fixed by the backend, whatever the environment says:
FIXED_ENV = {
    # Every put goes from the L1 straight on to RocksDB, synchronously: a page
    # set() reports stored survives a restart (AIBrix's default only moves
    # pages that turn "hot" in the L1, or evicted ones, and may drop writes).
    "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_TYPE": "ALL",
    "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_MAX_INFLIGHT_TOKENS": "0",
    # An L1 miss of even one page is looked up in RocksDB (AIBrix's default
    # skips RocksDB when fewer than 4 pages, or under 10 %, are missing).
    "AIBRIX_KV_CACHE_OL_DOUBLE_GET_THRESHOLD": "1",
    # A block is one of our pages: the block size is our page size, never overridden.
    "AIBRIX_KV_CACHE_OL_BLOCK_SIZE": "-1",
    # Keys are block hashes (our page keys), which needs the compact layout.
    "AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED": "0",
    "AIBRIX_KV_CACHE_OL_DEVICE": "cpu",
    # Direct mode: this process opens the RocksDB directory itself.
    "AIBRIX_KV_CACHE_OL_META_SERVICE_BACKEND": "",
    "AIBRIX_KV_CACHE_OL_L2_CACHE_NAMESPACE": "hicache",
}


def default_path() -> Path:
    return local_cache_dir() / "aibrix"


@dataclass(frozen=True)
class AibrixSettings:
    """One AIBrix cache: which tiers, how big, where RocksDB keeps its files."""

    path: Path
    l1: bool = True
    l1_capacity_bytes: int = DEFAULT_L1_CAPACITY_BYTES
    l1_eviction_policy: str = "S3FIFO"
    l2: bool = True
    ttl_s: int = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if not (self.l1 or self.l2):
            raise StorageError("aibrix storage: l1 and l2 are both off; enable at least one")
        if self.l1 and self.l1_capacity_bytes <= 0:
            raise StorageError("aibrix storage: l1_capacity must be > 0 bytes with l1 on")
        if self.l1_eviction_policy not in EVICTION_POLICIES:
            raise StorageError(
                f"aibrix storage: l1_eviction_policy must be one of "
                f"{', '.join(EVICTION_POLICIES)}, got {self.l1_eviction_policy!r}"
            )
        if self.ttl_s < 0:
            raise StorageError(f"aibrix storage: ttl_s must be >= 0, got {self.ttl_s}")

    @classmethod
    def from_options(cls, options: Options) -> AibrixSettings:
        options.reject_unknown(KNOWN_KEYS)
        path = options.string("path", None, env=(ENV["path"],))
        capacity = options.extra.get("l1_capacity")
        capacity_env = os.environ.get(ENV["l1_capacity"])
        if capacity is not None:
            capacity_bytes = parse_size(capacity, "aibrix storage: l1_capacity")
        elif capacity_env:
            capacity_bytes = _gigabytes(capacity_env)  # AIBrix's variable counts GiB
        else:
            capacity_bytes = DEFAULT_L1_CAPACITY_BYTES
        policy = _raw(options, "l1_eviction_policy")
        l2 = _raw(options, "l2")
        return cls(
            path=Path(path).expanduser() if path else default_path(),
            l1=_boolean(_raw(options, "l1"), True, "l1"),
            l1_capacity_bytes=capacity_bytes,
            l1_eviction_policy=str(policy).strip().upper() if policy is not None else "S3FIFO",
            # AIBrix names the L2 backend; this backend only knows RocksDB.
            l2=_l2_enabled(l2),
            ttl_s=_integer(_raw(options, "ttl_s"), DEFAULT_TTL_S, "ttl_s"),
        )

    def environment(self, rocksdb_root: Path) -> dict[str, str]:
        """Every ``AIBRIX_KV_CACHE_OL_*`` variable a cache manager is built under."""
        return {
            **FIXED_ENV,
            "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "1" if self.l1 else "0",
            "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB": repr(self.l1_capacity_bytes / 2**30),
            "AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY": self.l1_eviction_policy,
            "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "ROCKSDB" if self.l2 else "",
            "AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT": str(rocksdb_root),
            "AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S": str(self.ttl_s),
        }


def _raw(options: Options, key: str) -> object | None:
    """The extra config's value, else the AIBrix variable's (unset or empty: None)."""
    value: object | None = options.extra.get(key)
    if value is not None:
        return value
    return os.environ.get(ENV[key]) or None


def _boolean(value: object | None, default: bool, key: str) -> bool:
    return default if value is None else parse_bool(value, f"aibrix storage: {key}")


def _l2_enabled(value: object | None) -> bool:
    if isinstance(value, str) and value.strip().upper() in ("ROCKSDB", ""):
        return value.strip() != ""
    if isinstance(value, str) and value.strip().lower() not in ("true", "false", "1", "0"):
        raise StorageError(
            f"aibrix storage: l2 must be true or false (RocksDB on or off), got {value!r}; "
            "other AIBrix L2 backends are not supported here"
        )
    return _boolean(value, True, "l2")


def _integer(value: object | None, default: int, key: str) -> int:
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise StorageError(f"aibrix storage: {key} must be an integer, got {value!r}")


def _gigabytes(text: str) -> int:
    try:
        return int(float(text) * 2**30)
    except ValueError:
        raise StorageError(
            f"aibrix storage: environment variable {ENV['l1_capacity']} must be a number of "
            f"GiB, got {text!r}"
        ) from None
