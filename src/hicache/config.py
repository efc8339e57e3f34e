"""Frozen configuration dataclasses, one per component.

Each component receives only its own slice. Command-line parsing lives at the
edge (``hicache.server.args``, ``hicache.server.engine_args``); defaults are read
from these dataclasses so there is exactly one place that states them. Flag names
and defaults follow SGLang's so that existing launch scripts keep working.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class ConfigError(ValueError):
    """An invalid option or combination of options; the message says what to change."""


class WritePolicy(str, Enum):
    """When a device (L1) node is copied to host memory (L2)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @property
    def hit_count_threshold(self) -> int | None:
        """Hits after which a node is backed up; None means only on eviction."""
        return _WRITE_THRESHOLDS[self]


_WRITE_THRESHOLDS: dict[WritePolicy, int | None] = {
    WritePolicy.WRITE_THROUGH: 1,
    WritePolicy.WRITE_THROUGH_SELECTIVE: 2,
    WritePolicy.WRITE_BACK: None,
}


class IOBackendKind(str, Enum):
    """How pages move between the host pool and the device pool."""

    KERNEL = "kernel"  # Triton gather/scatter reading pinned host memory from the GPU
    DIRECT = "direct"  # torch copies, batched per contiguous run


class ReusePolicy(str, Enum):
    """How much of a prompt's cached prefix a request loads from the host tier and L3."""

    COST = "cost"  # the fastest split, priced with the live cost model (engine/reuse_plan.py)
    LOAD = "load"  # all the tiers hold, whatever it costs (waiting as the prefetch policy says)


class MemLayout(str, Enum):
    """Host pool memory layout (the device pool is always layer_first)."""

    # k|v: the planes of a layer (K and V; an MLA model's single latent)
    LAYER_FIRST = "layer_first"  # [layers][k|v][tokens] like the device pool
    PAGE_FIRST = "page_first"  # [pages][tokens][layers][k|v]: a page is one object
    PAGE_FIRST_DIRECT = "page_first_direct"  # [pages][layers][k|v][tokens]


def parse_enum(enum_type: type[Enum], value: object, flag: str) -> Enum:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(str(member.value) for member in enum_type)
        raise ConfigError(f"{flag}: unknown value {value!r}; choose one of: {choices}") from None


# The host pool as a multiple of the device pool when neither --hicache-ratio nor
# --hicache-size is given and nothing sizes it from the machine's memory.
DEFAULT_HICACHE_RATIO = 2.0


@dataclass(frozen=True)
class CacheConfig:
    """The hierarchical KV cache: page size, host pool sizing and policies."""

    page_size: int = 1
    enable_hierarchical_cache: bool = False
    # Host pool = ratio x device pool, unless hicache_size_gb > 0 (GB per rank, 1 GB = 1e9 B).
    # None: not given; the engine then sizes the host pool from the memory the machine
    # can spare (``memory.sizing``), and a cache built alone takes DEFAULT_HICACHE_RATIO.
    hicache_ratio: float | None = None
    hicache_size_gb: float = 0.0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    io_backend: IOBackendKind = IOBackendKind.KERNEL
    mem_layout: MemLayout = MemLayout.LAYER_FIRST
    # Host hits shorter than this are recomputed instead of loaded: a tiny load costs
    # more in launch and bookkeeping than recomputing a few tokens.
    load_back_threshold_tokens: int = 10
    reuse_policy: ReusePolicy = ReusePolicy.COST
    # Hints (cache/hints.py): the share of the host pool all pins together may hold, and
    # each tenant's pins; the longest TTL a pin or retain may ask (longer ones are clipped
    # to it); a retain's TTL when its hint gives none.
    pin_max_fraction: float = 0.5
    pin_tenant_fraction: float = 0.25
    hint_max_ttl_s: float = 86400.0
    retain_ttl_s: float = 600.0
    # The share of the host pool a warm (a prefetch hint, or POST /hicache/warm without
    # its own) may fill from L3: the server's --warm-host-fraction.
    warm_host_fraction: float = 0.5
    # Host quotas: the share of the host pool each listed tenant (extra_key; None is the
    # default tenant) may hold; a tenant over it evicts its own LRU host pages first
    # (``HierarchicalCache.alloc_host``). Unlisted tenants have no quota of their own.
    tenant_host_fractions: Mapping[str | None, float] = field(default_factory=dict)
    # The share of the host pool in its core set (radix/tree.py): evicted only after
    # every other page, so that prefixes reused in a loop larger than the host tier
    # keep hitting; 0 evicts least recently used first.
    host_core_fraction: float = 0.75

    def __post_init__(self) -> None:
        # Accept plain strings (from argparse or JSON) and normalise them to enums.
        object.__setattr__(
            self, "write_policy",
            parse_enum(WritePolicy, self.write_policy, "--hicache-write-policy"),
        )
        object.__setattr__(
            self, "io_backend",
            parse_enum(IOBackendKind, self.io_backend, "--hicache-io-backend"),
        )
        object.__setattr__(
            self, "mem_layout",
            parse_enum(MemLayout, self.mem_layout, "--hicache-mem-layout"),
        )
        object.__setattr__(
            self, "reuse_policy",
            parse_enum(ReusePolicy, self.reuse_policy, "--hicache-reuse-policy"),
        )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"--page-size must be a positive integer, got {self.page_size!r}")
        if self.hicache_size_gb < 0:
            raise ConfigError(
                f"--hicache-size must be >= 0 GB (0 means: use --hicache-ratio), "
                f"got {self.hicache_size_gb}"
            )
        if self.hicache_size_gb == 0 and self.hicache_ratio is not None and not (
            self.hicache_ratio > 1.0
        ):
            raise ConfigError(
                f"--hicache-ratio must be greater than 1 (the host pool must be larger than "
                f"the device pool), got {self.hicache_ratio}; raise it or set --hicache-size"
            )
        if self.load_back_threshold_tokens < 0:
            raise ConfigError("load_back_threshold_tokens must be >= 0")
        for flag, fraction in (("--hicache-pin-max-fraction", self.pin_max_fraction),
                               ("--hicache-pin-tenant-fraction", self.pin_tenant_fraction)):
            if not 0.0 <= fraction <= 1.0:
                raise ConfigError(
                    f"{flag} is a share of the host pool, in [0, 1] (0: no pins), got {fraction}"
                )
        for tenant, share in self.tenant_host_fractions.items():
            if not 0.0 <= share <= 1.0:
                raise ConfigError(
                    f"the host quota of tenant {tenant!r} is a share of the host pool, in "
                    f"[0, 1], got {share}"
                )
        if not 0.0 <= self.host_core_fraction < 1.0:
            raise ConfigError(
                f"--hicache-core-fraction is a share of the host pool, in [0, 1) (0: least "
                f"recently used first; some pages must stay outside it for new prefixes), "
                f"got {self.host_core_fraction}"
            )
        if not 0.0 < self.warm_host_fraction <= 1.0:
            raise ConfigError(
                f"--warm-host-fraction must be in (0, 1], got {self.warm_host_fraction}"
            )
        if not (math.isfinite(self.hint_max_ttl_s) and self.hint_max_ttl_s > 0):
            raise ConfigError(
                f"--hicache-hint-max-ttl-s must be a positive number of seconds, got "
                f"{self.hint_max_ttl_s}"
            )
        if not (math.isfinite(self.retain_ttl_s) and 0 < self.retain_ttl_s <= self.hint_max_ttl_s):
            raise ConfigError(
                f"--hicache-retain-ttl-s must be positive and at most --hicache-hint-max-ttl-s "
                f"({self.hint_max_ttl_s}), got {self.retain_ttl_s}"
            )

    @property
    def host_pool_from_flags(self) -> bool:
        """Whether the host pool's size was given (--hicache-size or --hicache-ratio)."""
        return self.hicache_size_gb > 0 or self.hicache_ratio is not None

    def host_num_pages(
        self, device_num_pages: int, page_bytes: int, available_bytes: int | None = None
    ) -> int:
        """Host pool size in pages for a device pool of ``device_num_pages``.

        Raises ConfigError when the host pool would not be larger than the device
        pool (L2 must be able to hold everything L1 holds, or write-through could
        not back up a full device pool), or when it is larger than
        ``available_bytes``, the memory the machine can spare for it (pinning more
        would fail, or drive the machine into swap and the OOM killer).
        """
        if page_bytes <= 0:
            raise ConfigError(f"page_bytes must be positive, got {page_bytes}")
        if self.hicache_size_gb > 0:
            host_pages = int(self.hicache_size_gb * 1e9) // page_bytes
            source = f"--hicache-size {self.hicache_size_gb} GB"
        else:
            ratio = self.hicache_ratio if self.hicache_ratio is not None else DEFAULT_HICACHE_RATIO
            host_pages = int(device_num_pages * ratio)
            source = f"--hicache-ratio {ratio}"
        if host_pages <= device_num_pages:
            need_gb = (device_num_pages + 1) * page_bytes / 1e9
            raise ConfigError(
                f"{source} gives a host pool of {host_pages} pages, not larger than the device "
                f"pool of {device_num_pages} pages ({device_num_pages * page_bytes / 1e9:.3f} GB); "
                f"set --hicache-size above {need_gb:.3f} or raise --hicache-ratio"
            )
        if available_bytes is not None and host_pages * page_bytes > available_bytes:
            raise ConfigError(
                f"{source} gives a host pool of {host_pages * page_bytes / 1e9:.3f} GB, more than "
                f"the {available_bytes / 1e9:.3f} GB of memory this machine can spare for it "
                f"(what is available, less a reserve for the rest of the process); "
                f"set --hicache-size below that, lower --hicache-ratio, or shrink the device "
                f"pool (--max-total-tokens, --mem-fraction-static)"
            )
        return host_pages
