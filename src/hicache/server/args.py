"""Command-line flags for the cache, with SGLang's names; defaults come from CacheConfig."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from hicache.config import (
    CacheConfig,
    ConfigError,
    IOBackendKind,
    MemLayout,
    ReusePolicy,
    WritePolicy,
)
from hicache.events.config import FLAG as KV_EVENTS_FLAG
from hicache.events.config import KVEventsConfig, parse_kv_events_config
from hicache.storage.config import (
    EXTRA_CONFIG_FLAG,
    PrefetchPolicy,
    StorageConfig,
    load_extra_config,
    storage_config,
)
from hicache.storage.registry import BACKENDS, SEALING_BACKENDS
from hicache.tenancy.keys import KEYS_FLAG, load_key_file
from hicache.tenancy.quotas import load_tenant_quotas

# Backends the registry knows (a new backend needs no edit here); "dynamic" loads any
# class named in the extra config.
STORAGE_BACKENDS = tuple(BACKENDS)
# Accepted by --hicache-storage-backend to turn L3 off where a default turns it on (serve).
NO_STORAGE_BACKEND = "none"

_DEFAULTS = {f.name: f.default for f in fields(CacheConfig)}


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hierarchical cache")
    group.add_argument(
        "--page-size", type=int, default=_DEFAULTS["page_size"],
        help="tokens per KV page (default: %(default)s)",
    )
    group.add_argument(
        "--enable-hierarchical-cache", action="store_true",
        help="back the device (L1) KV cache with a host memory (L2) pool",
    )
    # Both default to None: a host pool neither flag sizes is sized from the memory the
    # machine can spare (engine and memory.sizing), so the engine must see what was given.
    group.add_argument(
        "--hicache-ratio", type=float, default=None,
        help="host pool size as a multiple of the device pool; must be > 1 (default: twice "
        "the device pool where memory allows, else what the machine can spare)",
    )
    group.add_argument(
        "--hicache-size", type=float, default=None,
        help="host pool size in GB per rank; overrides --hicache-ratio when > 0",
    )
    group.add_argument(
        "--hicache-write-policy", choices=[p.value for p in WritePolicy],
        default=_DEFAULTS["write_policy"].value,
        help="when device pages are copied to the host (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-io-backend", choices=[b.value for b in IOBackendKind],
        default=_DEFAULTS["io_backend"].value,
        help="host<->device copy method; kernel falls back to direct without CUDA/Triton",
    )
    group.add_argument(
        "--hicache-mem-layout", choices=[m.value for m in MemLayout],
        default=_DEFAULTS["mem_layout"].value,
        help="host pool memory layout (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-reuse-policy", choices=[p.value for p in ReusePolicy],
        default=_DEFAULTS["reuse_policy"].value,
        help="cost: per request, load from the host tier and L3 only the pages that are "
        "faster to load than to compute again (priced with the live cost model); load: "
        "always load what the tiers hold (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-core-fraction", type=float, default=_DEFAULTS["host_core_fraction"],
        help="share of the host pool kept for prefixes reused before (its core set, "
        "evicted only after every other page), so that conversations coming back in a "
        "loop larger than the host tier keep hitting; in [0, 1), 0: least recently used "
        "first (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-pin-max-fraction", type=float, default=_DEFAULTS["pin_max_fraction"],
        help="share of the host pool that all pin hints together may hold, in [0, 1] "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--hicache-pin-tenant-fraction", type=float, default=_DEFAULTS["pin_tenant_fraction"],
        help="share of the host pool that one tenant's pin hints may hold, in [0, 1] "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--hicache-hint-max-ttl-s", type=float, default=_DEFAULTS["hint_max_ttl_s"],
        help="longest TTL a pin or retain hint may ask, in seconds; longer ones are clipped "
        "to it (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-retain-ttl-s", type=float, default=_DEFAULTS["retain_ttl_s"],
        help="a retain hint's TTL when it gives none, in seconds (default: %(default)s)",
    )


def add_storage_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("L3 storage")
    group.add_argument(
        "--hicache-storage-backend", choices=(*STORAGE_BACKENDS, NO_STORAGE_BACKEND),
        default=None,
        help="L3 storage backend shared by every instance; none: no L3 (default: %(default)s)",
    )
    group.add_argument(
        "--hicache-storage-prefetch-policy", choices=[p.value for p in PrefetchPolicy],
        default=StorageConfig.prefetch_policy.value,
        help="how long a request waits for its L3 prefetch (default: %(default)s)",
    )
    group.add_argument(
        EXTRA_CONFIG_FLAG, default=None, metavar="JSON|@FILE",
        help="JSON object, or @path to a .json/.toml/.yaml file: prefetch_threshold, "
        "prefetch_timeout_base, prefetch_timeout_per_ki_token (seconds, or \"auto\": follow "
        "the observed L3 read time), prefetch_timeout_max for the cache; every other key "
        "goes to the backend",
    )
    group.add_argument(
        KEYS_FLAG, default=None, metavar="FILE",
        help="encrypt every page written to L3 with AES-256-GCM under its tenant's key: "
        "lines '<tenant|*> <key id> <64 hex digits or base64>'; a tenant's last line "
        "writes, all its lines read; '*' is every tenant without lines of its own "
        "(file, redis and mooncake backends; default: pages are stored in the clear)",
    )
    group.add_argument(
        "--tenant-quotas", default=None, metavar="FILE",
        help="per-tenant limits, one line per tenant: '<tenant|default|*> l3=<bytes, e.g. "
        "2GB> host=<fraction of the host pool> l3_ttl=<seconds>' (at least one; host= not "
        "on the '*' line); a tenant over a quota evicts its own least recently used pages "
        "(default: no limits)",
    )


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV events")
    group.add_argument(
        KV_EVENTS_FLAG, default=None, metavar="JSON",
        help="publish KV cache events for a router (SGLang's and vLLM's format), e.g. "
        '\'{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": '
        '"tcp://127.0.0.1:5558", "topic": "kv-events"}\'; also buffer_steps, hwm, '
        "max_queue_size, and pin_events (true: also publish pins as BlockPinned, which "
        "hicache router reads and SGLang's router cannot) (default: off)",
    )


def kv_events_config_from_args(args: argparse.Namespace) -> KVEventsConfig:
    return parse_kv_events_config(getattr(args, "kv_events_config", None))


def storage_config_from_args(args: argparse.Namespace) -> StorageConfig:
    extra = load_extra_config(args.hicache_storage_backend_extra_config)
    backend = args.hicache_storage_backend
    if backend == NO_STORAGE_BACKEND:
        backend = None
    config = storage_config(backend, args.hicache_storage_prefetch_policy, extra)
    quotas_file = getattr(args, "tenant_quotas", None)  # parsers of the engine alone lack it
    if quotas_file is not None:
        config = replace(config, tenant_quotas=load_tenant_quotas(quotas_file))
    keys_file = getattr(args, "l3_encryption_keys", None)
    if keys_file is None:
        return config
    if backend is not None and backend not in SEALING_BACKENDS:
        raise ConfigError(
            f"{KEYS_FLAG}: the {backend} backend cannot encrypt pages; use one of "
            f"{', '.join(sorted(SEALING_BACKENDS))}"
        )
    return replace(config, encryption=load_key_file(keys_file))


def _tenant_host_fractions(args: argparse.Namespace) -> dict[str | None, float]:
    """The host= shares of ``--tenant-quotas`` (read here as well as for L3: a server
    without L3 still has host quotas)."""
    quotas_file = getattr(args, "tenant_quotas", None)  # parsers of the engine alone lack it
    return {} if quotas_file is None else load_tenant_quotas(quotas_file).host_fractions()


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """Build the CacheConfig; ConfigError messages name the flag to change."""
    try:
        return CacheConfig(
            page_size=args.page_size,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_ratio=args.hicache_ratio,
            hicache_size_gb=args.hicache_size if args.hicache_size is not None else 0.0,
            write_policy=args.hicache_write_policy,
            io_backend=args.hicache_io_backend,
            mem_layout=args.hicache_mem_layout,
            reuse_policy=args.hicache_reuse_policy,
            pin_max_fraction=args.hicache_pin_max_fraction,
            host_core_fraction=args.hicache_core_fraction,
            pin_tenant_fraction=args.hicache_pin_tenant_fraction,
            hint_max_ttl_s=args.hicache_hint_max_ttl_s,
            retain_ttl_s=args.hicache_retain_ttl_s,
            # A server flag (server/serve.py): parsers of the engine alone lack it.
            warm_host_fraction=getattr(args, "warm_host_fraction", 0.5),
            tenant_host_fractions=_tenant_host_fractions(args),
        )
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from error
