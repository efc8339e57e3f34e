"""Tenant names as logs, metrics and configuration files show them.

Invariants: the default tenant (``extra_key`` None) is labelled ``DEFAULT_TENANT_LABEL``;
a tenant name in a configuration file is 1-128 characters of ``[A-Za-z0-9_.:@-]``.
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
