"""L3 storage configuration: backend choice, prefetch policy, and the extra-config document.

``--hicache-storage-backend-extra-config`` is one JSON object, given inline or
as ``@path`` to a .json, .toml or .yaml file. The cache consumes the prefetch
keys below (validated here, with messages naming the key); every other key is
the backend's (``StorageConfig.backend_extra``).

``prefetch_timeout_per_ki_token`` may be ``"auto"``: the allowance then follows
the L3 read time observed over recent prefetches (``storage/bandwidth.py``),
and ``DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S`` applies until there is one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Final, Literal

from hicache.config import ConfigError, parse_enum
from hicache.tenancy.keys import KeyRing
from hicache.tenancy.quotas import TenantQuotas

EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
# prefetch_timeout_per_ki_token: follow the observed L3 read time.
AUTO: Final = "auto"
DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.1


class PrefetchPolicy(str, Enum):
    """When a request waiting on an L3 prefetch may start (with what has arrived)."""

    BEST_EFFORT = "best_effort"  # never wait: use what has landed when the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait until every page found in L3 has arrived
    TIMEOUT = "timeout"  # wait up to a deadline that grows with the prefetch size


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier as the cache sees it; ``backend`` None means no L3."""

    backend: str | None = None
    # Not best_effort: on a lightly loaded server a request is scheduled before its
    # prefetch lands, so best_effort would recompute what L3 holds. The timeout
    # bounds the wait when L3 is slow; a failing L3 trips the breaker instead.
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    # Only prefetch when L3 could add at least this many tokens past the local match.
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 2.0
    # Seconds per 1024 tokens, or "auto" (see the module docstring).
    prefetch_timeout_per_ki_token: float | Literal["auto"] = (
        DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S
    )
    prefetch_timeout_max: float = 30.0
    # Host pages that in-flight prefetches may hold, as a fraction of the host pool.
    prefetch_max_host_fraction: float = 0.5
    # Circuit breaker: after this many consecutive failed L3 calls stop calling for
    # a backoff that doubles from base to max while L3 keeps failing.
    breaker_failures: int = 3
    breaker_backoff_base: float = 0.5
    breaker_backoff_max: float = 30.0
    # Deadline of one L3 call (a batch of up to 128 pages): a call that has not
    # returned by then counts as failed ("timeout"), opens the breaker and is left
    # behind, its host pages reserved until it returns. Raise it for stores where
    # moving one batch can legitimately take longer.
    io_timeout_s: float = 10.0
    backend_extra: Mapping[str, Any] = field(default_factory=dict)
    # --l3-encryption-keys: every page written to L3 is sealed with its tenant's key
    # (``storage.sealing``); None: pages are stored in the clear.
    encryption: KeyRing | None = None
    # ``--tenant-quotas``: L3 bytes and page age per tenant, enforced by the backend
    # (``StorageBackend.set_tenant_quotas``; what each enforces: its docstring).
    tenant_quotas: TenantQuotas | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "prefetch_policy",
            parse_enum(PrefetchPolicy, self.prefetch_policy, "--hicache-storage-prefetch-policy"),
        )
        if self.prefetch_threshold < 0:
            raise ConfigError(f"prefetch_threshold must be >= 0, got {self.prefetch_threshold}")
        object.__setattr__(
            self, "prefetch_timeout_per_ki_token",
            _per_ki_token(self.prefetch_timeout_per_ki_token),
        )
        for name in ("prefetch_timeout_base", "prefetch_timeout_max", "breaker_backoff_base",
                     "breaker_backoff_max"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        fraction = self.prefetch_max_host_fraction
        if not 0 < fraction <= 1:
            raise ConfigError(f"prefetch_max_host_fraction must be in (0, 1], got {fraction}")
        if self.breaker_failures < 1:
            raise ConfigError(f"breaker_failures must be >= 1, got {self.breaker_failures}")
        timeout_s = self.io_timeout_s
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ConfigError(f"io_timeout_s must be a finite number > 0, got {timeout_s!r}")

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def auto_prefetch_timeout(self) -> bool:
        return self.prefetch_timeout_per_ki_token == AUTO

    def per_ki_token_s(self, observed_s: float | None = None) -> float:
        """Seconds per 1024 tokens in force: the configured number, or under ``auto`` the
        allowance ``observed_s`` that L3's read time calls for (None: not known yet)."""
        value = self.prefetch_timeout_per_ki_token
        if value != AUTO:
            return float(value)
        return DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S if observed_s is None else observed_s

    def prefetch_timeout(self, num_tokens: int, observed_per_ki_token_s: float | None = None
                         ) -> float:
        """Seconds a timeout-policy request waits for a prefetch of ``num_tokens``.

        ``observed_per_ki_token_s`` is used only under ``auto`` (``ReadTimeEstimate``).
        """
        per_ki_token_s = self.per_ki_token_s(observed_per_ki_token_s)
        grown = self.prefetch_timeout_base + per_ki_token_s * num_tokens / 1024
        return min(self.prefetch_timeout_max, grown)

    def same_backend(self, other: StorageConfig) -> bool:
        """Same store (re-attaching it only updates the policies)."""
        return (
            self.backend == other.backend
            and dict(self.backend_extra) == dict(other.backend_extra)
            and self.encryption == other.encryption
        )


# Keys of the extra config the cache consumes, with the types they must have.
_CACHE_KEYS: dict[str, type | tuple[type, ...]] = {
    "prefetch_threshold": int,
    "prefetch_timeout_base": (int, float),
    "prefetch_timeout_per_ki_token": (int, float, str),  # a number or "auto"
    "prefetch_timeout_max": (int, float),
    "prefetch_max_host_fraction": (int, float),
    "breaker_failures": int,
    "breaker_backoff_base": (int, float),
    "breaker_backoff_max": (int, float),
    "io_timeout_s": (int, float),
}
assert set(_CACHE_KEYS) <= {f.name for f in fields(StorageConfig)}


def _per_ki_token(value: object) -> float | Literal["auto"]:
    """Validate ``prefetch_timeout_per_ki_token``: "auto" or a finite number >= 0."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        return float(value)
    raise ConfigError(
        f'prefetch_timeout_per_ki_token must be "{AUTO}" or a finite number >= 0 '
        f"(seconds per 1024 tokens), got {value!r}"
    )


def load_extra_config(text: str | None) -> dict[str, Any]:
    """Parse the extra-config flag: inline JSON, or ``@path`` to a JSON/TOML/YAML file."""
    if text is None or not text.strip():
        return {}
    text = text.strip()
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            body = path.read_text()
        except OSError as error:
            raise ConfigError(f"{EXTRA_CONFIG_FLAG}: cannot read {path}: {error}") from None
        value = _parse_file(path, body)
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{EXTRA_CONFIG_FLAG}: not valid JSON ({error}); give a JSON object or @path"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{EXTRA_CONFIG_FLAG}: must be an object, got {type(value).__name__}")
    return value


def _parse_file(path: Path, body: str) -> Any:
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(body)
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef,unused-ignore]
            return tomllib.loads(body)
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ModuleNotFoundError:
                raise ConfigError(
                    f"{EXTRA_CONFIG_FLAG}: reading {path.name} needs PyYAML (pip install pyyaml)"
                ) from None
            return yaml.safe_load(body)
    except ConfigError:
        raise
    except Exception as error:  # each parser has its own error type
        raise ConfigError(f"{EXTRA_CONFIG_FLAG}: cannot parse {path}: {error}") from None
    raise ConfigError(f"{EXTRA_CONFIG_FLAG}: {path.name}: use a .json, .toml or .yaml file")


def storage_config(
    backend: str | None, prefetch_policy: str | PrefetchPolicy, extra: Mapping[str, Any]
) -> StorageConfig:
    """Split ``extra`` into the cache's keys (type-checked) and the backend's."""
    cache_values: dict[str, Any] = {}
    backend_extra: dict[str, Any] = {}
    for key, value in extra.items():
        expected = _CACHE_KEYS.get(key)
        if expected is None:
            backend_extra[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, expected):
            kind = "an integer" if expected is int else "a number"
            if key == "prefetch_timeout_per_ki_token":
                kind = f'"{AUTO}" or a number'
            raise ConfigError(
                f"{EXTRA_CONFIG_FLAG}: {key} must be {kind}, got {value!r} "
                f"({type(value).__name__})"
            )
        cache_values[key] = value
    policy = parse_enum(PrefetchPolicy, prefetch_policy, "--hicache-storage-prefetch-policy")
    return StorageConfig(
        backend=backend or None, prefetch_policy=PrefetchPolicy(policy),
        backend_extra=backend_extra, **cache_values,
    )
