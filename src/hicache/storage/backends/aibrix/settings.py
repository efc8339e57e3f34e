"""The aibrix backend's options, and the ``AIBRIX_KV_CACHE_OL_*`` environment they become.

AIBrix KVCache reads its whole configuration from environment variables when
a cache manager is built. Our extra-config keys are the few that matter for
an L3 tier; each falls back to the AIBrix variable of the same meaning (so a
deployment already configured for AIBrix keeps its settings), the extra config
winning. ``environment`` then renders the full set of variables a manager is
built under, including the ones we fix because the backend relies on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass

from hicache.local_cache import local_cache_dir
from hicache.storage.options import SETTINGS, Directory, Flag, FromEnv, Size, must, parse_bool

EVICTION_POLICIES = ("S3FIFO", "LRU", "FIFO")
# AIBrix's own default is 10 GB of host memory; an L3 tier beside our host pool
# (itself the L2) should not take that much unasked.
DEFAULT_L1_CAPACITY_BYTES = 2**30
# AIBrix's default: RocksDB drops a page at its first compaction past this age.
# That TTL is AIBrix's only bound on the RocksDB store's size.
DEFAULT_TTL_S = 600
# AIBrix's default: a RocksDB lookup or read of n tokens is given n times this
# long before it counts as a miss ("timeout"). On a loaded host that bound is
# tight (20 ms per token is 80 ms for a 4-token page), so it can be raised; our
# controller's io_timeout_s bounds every call in any case.
DEFAULT_TIMEOUT_PER_TOKEN_MS = 20

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


def _gigabytes(text: str) -> int:
    """Bytes from AIBrix's capacity variable, which counts GiB."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        raise ValueError(f"must be a number of GiB, got {text!r}") from None


def _l2_enabled(value: object) -> bool:
    # AIBrix names the L2 backend; this backend only knows RocksDB.
    if isinstance(value, str) and value.strip().upper() in ("ROCKSDB", ""):
        return value.strip() != ""
    if isinstance(value, str) and value.strip().lower() not in ("true", "false", "1", "0"):
        raise ValueError(
            f"must be true or false (RocksDB on or off), got {value!r}; "
            "other AIBrix L2 backends are not supported here"
        )
    return parse_bool(value)


def _eviction_policy(value: object) -> str:
    policy = str(value).strip().upper()
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    return policy


def _integer(value: object) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {value!r}")
    return value


def _aibrix(variable: str, parse: Callable[[str], object] = str) -> FromEnv:
    """The AIBrix variable a key falls back to (errors in its value name the key)."""
    return FromEnv(variable, parse=parse, name_variable=False)


@dataclass(frozen=True, config=SETTINGS)
class AibrixSettings:
    """One AIBrix cache: which tiers, how big, where RocksDB keeps its files."""

    path: Annotated[Directory, FromEnv("AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT")] = Field(
        default_factory=default_path
    )
    l1: Annotated[Flag, _aibrix("AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED")] = True
    l1_capacity_bytes: Annotated[
        Size, _aibrix("AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB", _gigabytes)
    ] = Field(default=DEFAULT_L1_CAPACITY_BYTES, alias="l1_capacity")
    l1_eviction_policy: Annotated[
        str, BeforeValidator(_eviction_policy),
        _aibrix("AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY"),
    ] = "S3FIFO"
    l2: Annotated[
        bool, BeforeValidator(_l2_enabled), _aibrix("AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND")
    ] = True
    ttl_s: Annotated[
        int, BeforeValidator(_integer), must(lambda ttl_s: ttl_s >= 0, "must be >= 0, got {}"),
        _aibrix("AIBRIX_KV_CACHE_OL_ROCKSDB_TTL_S"),
    ] = DEFAULT_TTL_S
    timeout_per_token_ms: Annotated[
        int, BeforeValidator(_integer),
        must(lambda ms: ms > 0, "must be > 0 milliseconds, got {}"),
        _aibrix("AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS"),
    ] = DEFAULT_TIMEOUT_PER_TOKEN_MS
    # The backend's, not the cache's: left out of equality so that it does not split stores.
    verify_checksum: Flag = dataclasses.field(default=True, compare=False)

    @model_validator(mode="after")
    def _tiers(self) -> AibrixSettings:
        if not (self.l1 or self.l2):
            raise ValueError("l1 and l2 are both off; enable at least one")
        if self.l1 and self.l1_capacity_bytes <= 0:
            raise ValueError("l1_capacity must be > 0 bytes with l1 on")
        return self

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
            "AIBRIX_KV_CACHE_OL_L2_CACHE_PER_TOKEN_TIMEOUT_MS": str(self.timeout_per_token_ms),
        }
