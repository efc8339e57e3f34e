"""Per-tenant quotas and retention, read from ``--tenant-quotas FILE``.

One tenant per line, ``#`` starts a comment, blank lines are ignored::

    # tenant      settings (at least one)
    acme          l3=2GB host=0.25 l3_ttl=3600
    default       l3=512MiB
    *             l3=1GB

- ``l3=<size>``: bytes of L3 the tenant's pages may take (``16GB`` = 16e9, ``16GiB`` =
  16 * 2^30); a backup past it evicts the tenant's own least recently used pages first,
  never another tenant's (what each backend can enforce: its module docstring).
- ``host=<fraction>``: the tenant's share of the host pool, in (0, 1]; enforced by the
  tree (``CacheConfig.tenant_host_fractions``, from ``TenantQuotas.host_fractions``), which
  keeps a heap per tenant with a quota: only a named tenant's line (or ``default``'s) may
  set it, not the ``*`` line.
- ``l3_ttl=<seconds>``: an L3 page older than this is a miss, and removed.

The tenant is a tenant name (``names.check_tenant_name``), ``default`` for the default
tenant (no cache salt), or ``*`` for every tenant not named on a line of its own.

Invariants: a file either loads whole or fails with a ``ConfigError`` that names the
file and the line; a tenant appears on at most one line; a tenant without a line of its
own, and no ``*`` line, has no limit (every getter answers None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hicache.config import ConfigError
from hicache.storage.options import parse_size
from hicache.tenancy.names import DEFAULT_TENANT_LABEL, check_tenant_name

ANY_TENANT = "*"
_KEYS = ("l3", "host", "l3_ttl")


@dataclass(frozen=True)
class TenantQuota:
    """One line's settings; None: not limited."""

    l3_bytes: int | None = None
    host_fraction: float | None = None
    l3_ttl_s: float | None = None


@dataclass(frozen=True)
class TenantQuotas:
    """Quotas by tenant (``extra_key``; None: the default tenant), and the ``*`` line."""

    by_tenant: Mapping[str | None, TenantQuota] = field(default_factory=dict)
    fallback: TenantQuota | None = None

    def quota(self, tenant: str | None) -> TenantQuota | None:
        """The tenant's line, else the ``*`` line, else None."""
        return self.by_tenant.get(tenant, self.fallback)

    def l3_bytes(self, tenant: str | None) -> int | None:
        quota = self.quota(tenant)
        return None if quota is None else quota.l3_bytes

    def l3_ttl_s(self, tenant: str | None) -> float | None:
        quota = self.quota(tenant)
        return None if quota is None else quota.l3_ttl_s

    def host_fraction(self, tenant: str | None) -> float | None:
        quota = self.quota(tenant)
        return None if quota is None else quota.host_fraction

    def host_fractions(self) -> dict[str | None, float]:
        """The host shares of the tenants whose lines set one (the ``*`` line cannot)."""
        return {
            tenant: quota.host_fraction
            for tenant, quota in self.by_tenant.items()
            if quota.host_fraction is not None
        }

    @property
    def has_l3_limits(self) -> bool:
        """Does any line bound a tenant's L3 bytes or page age?"""
        quotas = [*self.by_tenant.values(), *([self.fallback] if self.fallback else [])]
        return any(q.l3_bytes is not None or q.l3_ttl_s is not None for q in quotas)


def load_tenant_quotas(path: str | Path) -> TenantQuotas:
    """Read a quotas file; a ConfigError names the file (and line) when it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--tenant-quotas: cannot read {path}: {error}") from None
    return parse_tenant_quotas(text, str(path))


def parse_tenant_quotas(text: str, source: str) -> TenantQuotas:
    """Quotas from a file's ``text``; ``source`` (the file's name) starts every error."""
    by_tenant: dict[str | None, TenantQuota] = {}
    fallback: TenantQuota | None = None
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}:{number}"
        name, settings = words[0], words[1:]
        try:
            if name != ANY_TENANT:
                check_tenant_name(name)
            if name in seen:
                raise ValueError(f"tenant {name!r} is already given a line")
            quota = _parse_settings(settings)
            if name == ANY_TENANT and quota.host_fraction is not None:
                raise ValueError(
                    "host= is a tenant's own share of the host pool: give it on the "
                    "tenant's line, not the '*' line"
                )
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        seen.add(name)
        if name == ANY_TENANT:
            fallback = quota
        else:
            by_tenant[None if name == DEFAULT_TENANT_LABEL else name] = quota
    return TenantQuotas(by_tenant, fallback)


def _parse_settings(settings: list[str]) -> TenantQuota:
    if not settings:
        raise ValueError(f"a tenant needs at least one of {', '.join(k + '=' for k in _KEYS)}")
    values: dict[str, str] = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or not value:
            raise ValueError(f"expected key=value, got {setting!r}")
        if key not in _KEYS:
            raise ValueError(f"unknown setting {key!r} (known: {', '.join(_KEYS)})")
        if key in values:
            raise ValueError(f"{key}= is given twice")
        values[key] = value
    l3_bytes = host = ttl = None
    if "l3" in values:
        try:
            l3_bytes = parse_size(values["l3"])
        except ValueError as error:
            raise ValueError(f"l3= {error}") from None
    if "host" in values:
        host = _number(values["host"], "host")
        if not 0.0 < host <= 1.0:
            raise ValueError(f"host= is a fraction of the host pool in (0, 1], got {host}")
    if "l3_ttl" in values:
        ttl = _number(values["l3_ttl"], "l3_ttl")
        if ttl <= 0:
            raise ValueError(f"l3_ttl= is a number of seconds > 0, got {ttl}")
    return TenantQuota(l3_bytes=l3_bytes, host_fraction=host, l3_ttl_s=ttl)


def _number(text: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key}= must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{key}= must be finite, got {text!r}")
    return value
