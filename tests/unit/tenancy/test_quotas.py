"""--tenant-quotas files: what a line sets, which line a tenant gets, errors naming file:line."""

from __future__ import annotations

import pytest

from hicache.config import ConfigError
from hicache.tenancy.quotas import TenantQuota, parse_tenant_quotas


def test_lines_set_bytes_share_and_ttl_per_tenant() -> None:
    quotas = parse_tenant_quotas(
        "# tenants\nacme  l3=2GB host=0.25 l3_ttl=3600\n\ndefault l3=1KiB  # no salt\n* l3=1MB\n",
        "q.txt",
    )
    assert quotas.quota("acme") == TenantQuota(2 * 10**9, 0.25, 3600.0)
    assert quotas.l3_bytes(None) == 1024  # "default": the tenant without a cache salt
    assert quotas.l3_bytes("other") == 10**6  # the "*" line
    assert quotas.host_fraction("other") is None
    assert quotas.host_fraction("acme") == 0.25
    assert quotas.host_fractions() == {"acme": 0.25}
    assert quotas.l3_ttl_s("acme") == 3600.0 and quotas.l3_ttl_s(None) is None
    assert quotas.has_l3_limits


def test_a_tenant_without_a_line_or_star_is_unlimited() -> None:
    quotas = parse_tenant_quotas("acme host=0.5\n", "q.txt")
    assert quotas.quota("other") is None
    assert quotas.l3_bytes("other") is None and quotas.l3_ttl_s("acme") is None
    assert not quotas.has_l3_limits


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("acme\n", 1, "at least one of"),
        ("acme l3=lots\n", 1, "l3= must be a size"),
        ("ok l3=1\nacme quota=1\n", 2, "unknown setting 'quota'"),
        ("acme l3\n", 1, "expected key=value"),
        ("acme host=1.5\n", 1, "host= is a fraction"),
        ("acme host=0\n", 1, "host= is a fraction"),
        ("acme l3_ttl=0\n", 1, "l3_ttl= is a number of seconds > 0"),
        ("acme l3_ttl=soon\n", 1, "l3_ttl= must be a number"),
        ("bad/name l3=1\n", 1, "a tenant name is 1-128 characters"),
        ("acme l3=1\n\nacme l3=2\n", 3, "already given a line"),
        ("* l3=1\n* l3=2\n", 2, "already given a line"),
        ("acme l3=1 l3=2\n", 1, "given twice"),
        ("acme host=0.5\n* l3=1 host=0.1\n", 2, "not the '*' line"),
    ],
)
def test_bad_lines_name_the_file_and_line(text: str, line: int, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_tenant_quotas(text, "quotas.txt")
    assert str(raised.value).startswith(f"quotas.txt:{line}: ")
    assert says in str(raised.value)
