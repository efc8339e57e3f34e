"""Nested namespaces: which tenants a namespace sits in (``namespace_chain``), agreeing with
``within_tenant``, and the key-value stores' name prefixes built from them."""

from __future__ import annotations

import re

import pytest

from hicache.storage.backends.file.tenant_dirs import (
    NESTED_PREFIX_REGEX,
    tenant_dir_name,
    tenant_key_prefix,
)
from hicache.tenancy.names import namespace_chain, within_tenant


@pytest.mark.parametrize(("extra_key", "chain"), [
    ("acme", ["acme"]),
    ("acme/s1", ["acme", "acme/s1"]),
    ("acme/s1\x00e", ["acme", "acme/s1", "acme/s1\x00e"]),
    ("salt\x00extra", ["salt", "salt\x00extra"]),
    ("/odd", ["/odd"]),  # a leading separator nests in no tenant
])
def test_the_chain_names_every_enclosing_namespace(extra_key: str, chain: list[str]) -> None:
    assert namespace_chain(extra_key) == chain
    for outer in chain:
        assert within_tenant(extra_key, outer)


def test_a_nested_prefix_extends_its_tenants_and_no_other() -> None:
    acme, nested, lookalike = (tenant_key_prefix(t) for t in ("acme", "acme/s1\x00e", "acme2"))
    assert acme == tenant_dir_name("acme") + ":"
    assert nested.startswith(acme) and not lookalike.startswith(acme)
    pattern = re.compile("^" + re.escape(acme) + NESTED_PREFIX_REGEX + "page$")
    assert pattern.match(acme + "page") and pattern.match(nested + "page")
    assert not pattern.match(lookalike + "page")
