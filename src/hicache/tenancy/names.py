"""Tenant names: how a tenant is written in logs, metrics and admin routes.

Invariant: a tenant is its cache salt (``extra_key``); None is the default tenant,
labelled ``DEFAULT_TENANT_LABEL``. A name a client or an operator gives is checked by
``check_tenant_name`` before it reaches the cache.
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
