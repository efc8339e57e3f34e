"""Where the file backend keeps a tenant's pages: a directory level per tenant.

The default tenant's pages (no cache salt) stay at ``<root>/<2 hex>/<name>``, where the
router's shared-pool lookups and older instances find them. Tenant ``t``'s pages live
at ``<root>/tenants/<dir>/<2 hex>/<name>``, ``<dir>`` being ``t`` plus a hash of the
tenant (any salt text maps to a short, safe directory name); the directory's ``tenant``
file holds the tenant's name, so a scan (at attach, by any instance sharing the
directory) knows whose pages they are.

Invariants: the name file is written (atomically: a temporary renamed into place)
before the first page of its directory; a tenant directory without a readable name file
is skipped by scans (its pages are not adopted, counted or purged); two tenants never
share a directory (the hash is of the whole name, and the name file is checked).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from hicache.tenancy.names import namespace_chain

TENANTS_DIR = "tenants"
NAME_FILE = "tenant"


def tenant_dir_name(tenant: str) -> str:
    return "t" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def tenant_key_prefix(tenant: str) -> str:
    """What a key-value store's object names of ``tenant`` start with (Redis, Mooncake):
    the ``tenant_dir_name`` of each namespace it is nested in, outermost first, each
    followed by ":". A namespace nested in a tenant so starts with the tenant's prefix
    (one match purges both), and no other tenant's does (the hashes are of whole names)."""
    return "".join(tenant_dir_name(name) + ":" for name in namespace_chain(tenant))


# What follows a tenant's ``tenant_key_prefix`` in the names of the namespaces nested in it.
NESTED_PREFIX_REGEX = r"(?:t[0-9a-f]{32}:)*"


def tenant_root(root: str, tenant: str | None) -> str:
    """The directory holding ``tenant``'s fan-out directories."""
    if tenant is None:
        return root
    return f"{root}/{TENANTS_DIR}/{tenant_dir_name(tenant)}"


def ensure_tenant_dir(root: str, tenant: str) -> None:
    """Create ``tenant``'s directory and its name file, unless they exist."""
    directory = tenant_root(root, tenant)
    name_file = f"{directory}/{NAME_FILE}"
    if os.path.isfile(name_file):
        return
    os.makedirs(directory, exist_ok=True)
    # The writer's process and thread in the name: a batch's pages are written on
    # several threads, each of which may be the tenant's first.
    temp = f"{name_file}.{os.getpid()}-{threading.get_ident()}.tmp"
    with open(temp, "w", encoding="utf-8", errors="surrogatepass") as out:
        out.write(tenant)
    os.replace(temp, name_file)


def tenant_dirs(root: Path) -> list[tuple[str, Path]]:
    """(tenant, directory) of every tenant directory under ``root`` with a name file
    that names it."""
    found: list[tuple[str, Path]] = []
    base = root / TENANTS_DIR
    if not base.is_dir():
        return found
    for directory in base.iterdir():
        with contextlib.suppress(OSError, UnicodeDecodeError):
            tenant = (directory / NAME_FILE).read_text(encoding="utf-8", errors="surrogatepass")
            if tenant_dir_name(tenant) == directory.name:
                found.append((tenant, directory))
    return found
