"""``hicache router`` flags, as one frozen :class:`RouterSettings`.

argparse lives only here (``add_arguments`` / ``settings_from_args``); every
other part of the router reads the dataclass. Defaults are the dataclass's.
Names follow Dynamo's KV router (``--shared-cache-type``, ``--shared-cache-multiplier``,
``--overlap-weight``) and SGLang's router (``--worker-urls``; for prefill-decode
disaggregation ``--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...``).
"""

from __future__ import annotations

import argparse
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from hicache.config import ConfigError
from hicache.router.credentials import redact
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, add_max_request_bytes_arg
from hicache.tenancy.identity import TenantIdentity, add_identity_args, identity_from_flags


class PolicyName(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"  # device overlap only: Dynamo's default KV routing
    TIER_AWARE = "tier_aware"  # Dynamo's shared-cache routing: every tier, and the shared pool
    # Each worker's predicted TTFT from its live costs and the router's ledger of its queue.
    PREDICTED_TTFT = "predicted_ttft"


class SharedCacheType(str, enum.Enum):
    NONE = "none"
    HICACHE = "hicache"  # ask the Mooncake master which of the request's pages it holds


class TierCostsMode(str, enum.Enum):
    FIXED = "fixed"  # one multiplier for every worker
    MEASURED = "measured"  # each worker's own bandwidths and prefill rate


class DecodePolicyName(str, enum.Enum):
    """How a decode instance is chosen: no prefix matters there (its KV comes from the
    prefill instance), only load."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"


# SGLang's default --disaggregation-bootstrap-port: a prefill instance named without one.
DEFAULT_BOOTSTRAP_PORT = 8998


class SettingsError(ValueError):
    """A flag value the router cannot run with; the message names the flag."""


@dataclass(frozen=True)
class RouterSettings:
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: PolicyName = PolicyName.TIER_AWARE
    # Dynamo's default is 1.0. Behind this router, workers on CPUs pay far more for a page
    # of prefill than Dynamo's load term (in-flight prompt pages) says: at 1.0 tier_aware
    # sent turns away from the worker holding their prefix and gained nothing over
    # round_robin; at 4.0 it kept them there and measured 1.56x round_robin's throughput
    # with 35% lower mean TTFT than cache_aware (docs/benchmarks.md, `hicache bench
    # router`). Against the pending prefill (the default load term) 4.0 also measured at or
    # ahead of 1.0 on every point of the router sweep's A/B (2026-11-29): each page a turn
    # recomputes delays every request queued behind it, not only its own first token.
    # None (``auto``): tier_aware derives each worker's weight from its queue and cache
    # (policy.py). Measured level with 4.0 on the sweep's closed-loop points and behind it
    # under light load (ws 1 Poisson 50%: mean TTFT 0.83x SGLang's against 0.78x), so 4.0
    # stays the default (docs/benchmarks.md, 2026-11-30). predicted_ttft with --ttft-score
    # cluster, which has no weight, measured level on throughput and behind on TTFT over the
    # whole short grid (mean <= 0.8x SGLang's on 3 points against 7: 2026-12-02).
    overlap_weight: float | None = 4.0
    shared_cache_multiplier: float = 0.0
    shared_cache_type: SharedCacheType = SharedCacheType.NONE
    tier_costs: TierCostsMode = TierCostsMode.FIXED
    # tier_aware, predicted_ttft: a conversation's turns go to its last turn's worker
    # while that costs a turn no more than its own prefill (router/affinity.py). Off: in
    # an A/B on the router sweep it was level at ws 2 and lost at ws 4 (its p99 TTFT 2x).
    conversation_affinity: bool = False
    # tier_aware's load term: "prompt_pages" (Dynamo's decode_blocks) or "pending_prefill"
    # (the pages still to compute before the first tokens of what was sent there).
    # "pending_prefill": at weight 4 it measured at or ahead of prompt_pages on every point
    # of the router sweep's A/B but one (docs/benchmarks.md, 2026-11-29).
    load_term: str = "pending_prefill"
    # predicted_ttft's score: "own" (the request's predicted TTFT) or "cluster" (plus the
    # delay its forward causes the others on that worker: router/ttft_policy.py).
    ttft_score: str = "own"
    tokenizer: str | None = None  # None: the workers' model (their /get_server_info)
    # None: the admin routes need no key. Set, it guards the worker list, /flush_cache and
    # /abort_request with abort_all (the client's key is passed on to the workers).
    admin_api_key: str | None = None
    # --api-keys and --tenant-header: who a request is, hence its tenant (tenancy.identity).
    identity: TenantIdentity = field(default_factory=TenantIdentity)
    # Largest request body accepted (a 413 beyond it, before it is read), as the workers'.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    # How long start-up waits for the --worker-urls to answer /get_server_info.
    worker_startup_timeout_s: float = 300.0
    # How long a joining worker's warm from L3 may take before it is routed to (0: no
    # warm, a joining worker is routed to at once). See router/warm.py.
    warm_on_join_timeout_s: float = 20.0
    # Prefill-decode disaggregation: each request goes to a prefill instance (chosen by
    # --policy, from its cached prefix) and a decode instance (by --decode-policy).
    pd_disaggregation: bool = False
    prefill: tuple[PrefillEndpoint, ...] = ()
    decode_urls: tuple[str, ...] = ()
    decode_policy: DecodePolicyName = DecodePolicyName.LEAST_LOAD

    def __post_init__(self) -> None:
        for url in (*self.worker_urls, *self.decode_urls):
            check_worker_url(url)
        for endpoint in self.prefill:
            check_worker_url(endpoint.url)
        self._check_pd()
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port must be in 1..65535, got {self.port}")
        if self.overlap_weight is not None and not self.overlap_weight >= 0:
            raise SettingsError(f"--overlap-weight must be >= 0 or auto, got "
                                f"{self.overlap_weight}")
        if self.shared_cache_multiplier < 0:
            raise SettingsError(
                f"--shared-cache-multiplier must be >= 0, got {self.shared_cache_multiplier}"
            )
        for name, value in (("--health-interval", self.health_interval_s),
                            ("--request-timeout", self.request_timeout_s),
                            ("--worker-startup-timeout", self.worker_startup_timeout_s)):
            if not value > 0:
                raise SettingsError(f"{name} must be > 0 seconds, got {value}")
        if not (self.warm_on_join_timeout_s >= 0 and math.isfinite(self.warm_on_join_timeout_s)):
            raise SettingsError("--warm-on-join-timeout-s must be >= 0 seconds (0: no warm), "
                                f"got {self.warm_on_join_timeout_s}")
        if self.max_request_bytes <= 0:
            raise SettingsError(f"--max-request-bytes must be > 0, got {self.max_request_bytes}")

    def _check_pd(self) -> None:
        if not self.pd_disaggregation:
            if self.prefill or self.decode_urls:
                raise SettingsError("--prefill and --decode need --pd-disaggregation")
            return
        if self.worker_urls:
            raise SettingsError("--pd-disaggregation routes over --prefill and --decode "
                                "instances; --worker-urls cannot be used with it")
        if not self.prefill or not self.decode_urls:
            raise SettingsError("--pd-disaggregation needs at least one --prefill URL and "
                                "one --decode URL")
        overlap = {p.url for p in self.prefill} & set(self.decode_urls)
        if overlap:
            raise SettingsError(f"{sorted(overlap)[0]} is given as both --prefill and "
                                "--decode: an instance runs in one disaggregation mode")

    def public(self) -> dict[str, object]:
        """The settings as /get_server_info shows them (the admin key only as set or not,
        worker URLs without their credentials)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "admin_api_key":
                value = value is not None
            elif f.name == "identity":  # whether keys are required, never their digests
                value = {"api_keys": value.api_keys is not None,
                         "tenant_header": value.tenant_header}
            elif isinstance(value, enum.Enum):
                value = value.value
            elif f.name == "prefill":
                value = [p.public() for p in value]
            elif f.name in ("worker_urls", "decode_urls"):
                value = [redact(url) for url in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


@dataclass(frozen=True)
class PrefillEndpoint:
    """A prefill instance: its HTTP url and the port of its bootstrap server (where
    decode instances register the pages a request's KV goes to)."""

    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT

    def __post_init__(self) -> None:
        if not 0 < self.bootstrap_port < 65536:
            raise SettingsError(f"--prefill {self.url}: the bootstrap port must be in "
                                f"1..65535, got {self.bootstrap_port}")

    def public(self) -> dict[str, object]:
        return {"url": redact(self.url), "bootstrap_port": self.bootstrap_port}


def _overlap_weight(text: object) -> float | None:
    """``--overlap-weight``: a number, or ``auto`` (None: derived per worker)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    try:
        return float(str(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--overlap-weight takes a number >= 0 or auto, not {text!r}") from None


def parse_prefill_args(groups: Sequence[Sequence[str]]) -> tuple[PrefillEndpoint, ...]:
    """``--prefill URL [BOOTSTRAP_PORT]`` groups (SGLang's form) as endpoints; a port left
    out, or SGLang's ``none``, is the default bootstrap port. Repeats of a URL are one."""
    endpoints: dict[str, PrefillEndpoint] = {}
    for group in groups:
        if not 1 <= len(group) <= 2:
            raise SettingsError(f"--prefill takes a URL and an optional bootstrap port, got "
                                f"{' '.join(group)!r}")
        url = check_worker_url(group[0])
        port = DEFAULT_BOOTSTRAP_PORT
        if len(group) == 2 and group[1].lower() != "none":
            try:
                port = int(group[1])
            except ValueError:
                raise SettingsError(f"--prefill {url}: bootstrap port {group[1]!r} is not a "
                                    "number (give a port, or none for the default "
                                    f"{DEFAULT_BOOTSTRAP_PORT})") from None
        endpoint = PrefillEndpoint(url, port)
        known = endpoints.setdefault(url, endpoint)
        if known != endpoint:
            raise SettingsError(f"--prefill {url} is given twice with different bootstrap "
                                f"ports ({known.bootstrap_port} and {port})")
    return tuple(endpoints.values())


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
        "--overlap-weight", type=_overlap_weight,
        default="auto" if d.overlap_weight is None else d.overlap_weight,
        help="weight of the prefill pages left to compute against the load term; auto: "
        "tier_aware derives it per worker, 1 + its requests waiting for a first token + how "
        "full its cache is (default: %(default)s)",
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
        help="fixed: one cost per tier; measured: each worker's live cost model (its prefill, "
        "host load and L3 read estimates; its totals until they are known) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--conversation-affinity", choices=["on", "off"],
        default="on" if d.conversation_affinity else "off",
        help="tier_aware and predicted_ttft: send a conversation's turn to the worker its "
        "last turn went to, unless that costs the turn more than its own prefill there, "
        "also once its pages have left every worker's device and host "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--load-term", choices=["prompt_pages", "pending_prefill"], default=d.load_term,
        help="tier_aware's load term: prompt_pages counts every prompt page of the requests "
        "in flight on a worker (Dynamo's decode_blocks); pending_prefill the pages they "
        "still compute there before their first tokens, as routed (default: %(default)s)",
    )
    group.add_argument(
        "--ttft-score", choices=["own", "cluster"], default=d.ttft_score,
        help="predicted_ttft's score: own minimises the request's predicted TTFT; cluster "
        "adds the delay its forward causes the requests in flight on that worker and the "
        "cached pages it evicts there (default: %(default)s)",
    )
    group.add_argument(
        "--tokenizer", default=None,
        help="tokenizer dir used to hash requests' pages (default: the workers' model, from "
        "their /get_server_info tokenizer_path)",
    )
    group.add_argument(
        "--admin-api-key", default=None,
        help="bearer key for POST/DELETE /workers, /flush_cache and /abort_request with "
        "abort_all; the key a client sends is passed on to the workers, so give them the same "
        "--admin-api-key (default: no key needed)",
    )
    add_identity_args(group)
    add_max_request_bytes_arg(group, d.max_request_bytes)
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
    group.add_argument(
        "--warm-on-join-timeout-s", type=float, default=d.warm_on_join_timeout_s,
        help="a worker that joins (POST /workers, or back after a restart) first gets the "
        "most recent prompts prefetched from L3 into its host tier (up to its "
        "--warm-host-fraction), and is routed to once that is done or after this many "
        "seconds; 0 routes to it at once (default: %(default)s)",
    )
    pd = parser.add_argument_group("prefill-decode disaggregation")
    pd.add_argument(
        "--pd-disaggregation", action="store_true",
        help="send each request to a prefill instance and a decode instance together "
        "(hicache serve --disaggregation-mode prefill|decode); the decode one answers",
    )
    pd.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill instance and, optionally, its --disaggregation-bootstrap-port "
        f"(default {DEFAULT_BOOTSTRAP_PORT}); repeat for more. Chosen by --policy",
    )
    pd.add_argument(
        "--decode", nargs=1, action="append", default=[], metavar="URL",
        help="a decode instance; repeat for more",
    )
    pd.add_argument(
        "--decode-policy", choices=[p.value for p in DecodePolicyName],
        default=d.decode_policy.value,
        help="how a decode instance is chosen (default: %(default)s)",
    )
    # SUPPRESS: when not given here, ``hicache --log-level`` (before the subcommand) stands.
    group.add_argument("--log-level", default=argparse.SUPPRESS,
                       help="python logging level (default: info)")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Raises SettingsError on a bad value."""
    urls = tuple(dict.fromkeys(normalize_worker_url(u) for u in args.worker_urls))
    try:
        identity = identity_from_flags(args.api_keys, args.tenant_header)
    except ConfigError as error:
        raise SettingsError(str(error)) from None
    return RouterSettings(
        worker_urls=urls, host=args.host, port=args.port, policy=PolicyName(args.policy),
        overlap_weight=_overlap_weight(args.overlap_weight),
        shared_cache_multiplier=args.shared_cache_multiplier,
        shared_cache_type=SharedCacheType(args.shared_cache_type),
        tier_costs=TierCostsMode(args.tier_costs), tokenizer=args.tokenizer,
        conversation_affinity=args.conversation_affinity == "on", load_term=args.load_term,
        ttft_score=args.ttft_score,
        admin_api_key=args.admin_api_key or None,  # an empty key would let anyone in
        identity=identity,
        health_interval_s=args.health_interval, request_timeout_s=args.request_timeout,
        worker_startup_timeout_s=args.worker_startup_timeout,
        warm_on_join_timeout_s=args.warm_on_join_timeout_s,
        max_request_bytes=args.max_request_bytes,
        pd_disaggregation=args.pd_disaggregation, prefill=parse_prefill_args(args.prefill),
        decode_urls=tuple(dict.fromkeys(normalize_worker_url(u) for (u,) in args.decode)),
        decode_policy=DecodePolicyName(args.decode_policy),
    )
