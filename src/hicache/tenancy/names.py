"""Tenant names: the label of the default tenant and the rule a configured name follows.

Invariants: ``tenant_label`` maps the default tenant (``extra_key`` None) to
``DEFAULT_TENANT_LABEL`` and every other tenant to its own ``extra_key``; a name
``check_tenant_name`` accepts never contains "/" (nested salts use it, see
``identity``) nor whitespace (key files split on it).
"""

from __future__ import annotations

import re

DEFAULT_TENANT_LABEL = "default"
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


def tenant_label(extra_key: str | None) -> str:
    return DEFAULT_TENANT_LABEL if extra_key is None else extra_key


def check_tenant_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"a tenant name is 1-128 characters of A-Z a-z 0-9 _ . : @ -, got {name!r}"
        )
    return name


# How namespaces nest inside a tenant: a salt under an authenticated tenant ("acme/s1",
# tenancy/identity.py) and an extra key under a salt ("acme\x00e", server/protocol.py).
NESTING_SEPARATORS = ("/", "\x00")


def within_tenant(extra_key: str | None, tenant: str | None) -> bool:
    """Whether ``extra_key`` is ``tenant``'s namespace or one nested in it (what a purge of
    ``tenant`` removes). The default tenant (None) has nothing nested."""
    if extra_key is None or tenant is None:
        return extra_key == tenant
    return extra_key == tenant or extra_key.startswith(
        tuple(tenant + separator for separator in NESTING_SEPARATORS)
    )


def namespace_chain(extra_key: str) -> list[str]:
    """``extra_key`` and the namespaces it is nested in, outermost first
    (``"acme/s1\x00e"`` -> ``["acme", "acme/s1", "acme/s1\x00e"]``): each entry is a
    tenant whose purge takes ``extra_key`` (``within_tenant``)."""
    cuts = [i for i, char in enumerate(extra_key) if i and char in NESTING_SEPARATORS]
    return [extra_key[:i] for i in cuts] + [extra_key]
