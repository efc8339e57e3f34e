"""``hicache router`` flags, as one frozen :class:`RouterSettings`.

argparse lives only here (``add_arguments`` / ``settings_from_args``); every
other part of the router reads the dataclass. Defaults are the dataclass's.
Names follow seed 001 (Dynamo's ``--shared-cache-type``, ``--shared-cache-multiplier``,
``--overlap-weight``) and SGLang's router (``--worker-urls``).
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, fields
from urllib.parse import urlsplit


class PolicyName(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"  # device overlap only: Dynamo's default KV routing
    TIER_AWARE = "tier_aware"  # seed 001: every tier, and the shared pool


class SharedCacheType(str, enum.Enum):
    NONE = "none"
    HICACHE = "hicache"  # ask the Mooncake master which of the request's pages it holds


class TierCostsMode(str, enum.Enum):
    FIXED = "fixed"  # one multiplier for every worker
    MEASURED = "measured"  # each worker's own bandwidths and prefill rate


class SettingsError(ValueError):
    """A flag value the router cannot run with; the message names the flag."""


@dataclass(frozen=True)
class RouterSettings:
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: PolicyName = PolicyName.TIER_AWARE
    # Dynamo's default is 1.0. Behind this router, workers on CPUs pay far more for a page
    # of prefill than the load term (in-flight prompt pages) says: at 1.0 tier_aware sent
    # turns away from the worker holding their prefix and gained nothing over round_robin;
    # at 4.0 it kept them there and measured 1.56x round_robin's throughput with 35% lower
    # mean TTFT than cache_aware (docs/benchmarks.md, `hicache bench router`).
    overlap_weight: float = 4.0
    shared_cache_multiplier: float = 0.0
    shared_cache_type: SharedCacheType = SharedCacheType.NONE
    tier_costs: TierCostsMode = TierCostsMode.FIXED
    tokenizer: str | None = None  # None: the workers' model (their /get_server_info)
    admin_api_key: str | None = None  # None: the admin routes need no key
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    # How long start-up waits for the --worker-urls to answer /get_server_info.
    worker_startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for url in self.worker_urls:
            check_worker_url(url)
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port must be in 1..65535, got {self.port}")
        if self.overlap_weight < 0:
            raise SettingsError(f"--overlap-weight must be >= 0, got {self.overlap_weight}")
        if self.shared_cache_multiplier < 0:
            raise SettingsError(
                f"--shared-cache-multiplier must be >= 0, got {self.shared_cache_multiplier}"
            )
        for name, value in (("--health-interval", self.health_interval_s),
                            ("--request-timeout", self.request_timeout_s),
                            ("--worker-startup-timeout", self.worker_startup_timeout_s)):
            if not value > 0:
                raise SettingsError(f"{name} must be > 0 seconds, got {value}")

    def public(self) -> dict[str, object]:
        """The settings as /get_server_info shows them (the admin key only as set or not)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "admin_api_key":
                value = value is not None
            elif isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def normalize_worker_url(url: str) -> str:
    """The form a worker is known by: no trailing slash, no surrounding blanks."""
    return url.strip().rstrip("/")


def check_worker_url(url: str) -> str:
    """``url`` normalized; SettingsError unless it is ``http(s)://host[:port]``."""
    url = normalize_worker_url(url)
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise SettingsError(f"worker url {url!r} has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"worker url {url!r} must look like http://host:port")
    if parts.path or parts.query or parts.fragment:
        raise SettingsError(f"worker url {url!r} must be only scheme, host and port")
    return url


_DEFAULTS = RouterSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    group = parser.add_argument_group("router")
    group.add_argument(
        "--worker-urls", nargs="*", default=[], metavar="URL",
        help="workers to route to (hicache serve or SGLang servers); more can be added at run "
        "time with POST /workers",
    )
    group.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=d.port, help="default: %(default)s")
    group.add_argument(
        "--policy", choices=[p.value for p in PolicyName], default=d.policy.value,
        help="how a worker is chosen (default: %(default)s)",
    )
    group.add_argument(
        "--overlap-weight", type=float, default=d.overlap_weight,
        help="weight of the prefill pages left to compute against the decode load "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--shared-cache-multiplier", type=float, default=d.shared_cache_multiplier,
        help="discount for shared-pool pages past a worker's device prefix: 0 ignores them, "
        "1 counts them as device hits (default: %(default)s)",
    )
    group.add_argument(
        "--shared-cache-type", choices=[t.value for t in SharedCacheType],
        default=d.shared_cache_type.value,
        help="hicache: ask the Mooncake master which pages the shared L3 holds "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--tier-costs", choices=[t.value for t in TierCostsMode], default=d.tier_costs.value,
        help="fixed: one cost per tier; measured: each worker's bandwidths and prefill rate "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--tokenizer", default=None,
        help="tokenizer dir used to hash requests' pages (default: the workers' model, from "
        "their /get_server_info tokenizer_path)",
    )
    group.add_argument(
        "--admin-api-key", default=None,
        help="bearer key for POST/DELETE /workers (default: no key needed)",
    )
    group.add_argument(
        "--health-interval", type=float, default=d.health_interval_s,
        help="seconds between GET /health probes of each worker (default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout", type=float, default=d.request_timeout_s,
        help="seconds a worker may stay silent in a proxied request (default: %(default)s)",
    )
    group.add_argument(
        "--worker-startup-timeout", type=float, default=d.worker_startup_timeout_s,
        help="seconds start-up waits for --worker-urls to answer (default: %(default)s)",
    )
    # SUPPRESS: when not given here, ``hicache --log-level`` (before the subcommand) stands.
    group.add_argument("--log-level", default=argparse.SUPPRESS,
                       help="python logging level (default: info)")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Raises SettingsError on a bad value."""
    urls = tuple(dict.fromkeys(normalize_worker_url(u) for u in args.worker_urls))
    return RouterSettings(
        worker_urls=urls, host=args.host, port=args.port, policy=PolicyName(args.policy),
        overlap_weight=args.overlap_weight,
        shared_cache_multiplier=args.shared_cache_multiplier,
        shared_cache_type=SharedCacheType(args.shared_cache_type),
        tier_costs=TierCostsMode(args.tier_costs), tokenizer=args.tokenizer,
        admin_api_key=args.admin_api_key or None,  # an empty key would let anyone in
        health_interval_s=args.health_interval, request_timeout_s=args.request_timeout,
        worker_startup_timeout_s=args.worker_startup_timeout,
    )
