"""Who a request is: ``--api-keys`` files, ``--tenant-header``, and the precedence.

A key file has one key per line, ``<sha256 hex of the key> <tenant>`` or
``plain:<key> <tenant>`` (hashed when loaded, so only digests stay in memory);
``#`` starts a comment, blank lines are skipped. Any other line, a tenant name
``names.check_tenant_name`` refuses, a key given twice or a file with no key is a
``ConfigError`` naming ``file:line``.

A request's tenant (its engine ``extra_key``), by precedence:

1. the body's cache key (``cache_salt`` / ``extra_key``, ``server.protocol.cache_key``);
2. the tenant of the caller's API key (``Authorization: Bearer <key>``);
3. the tenant a trusted gateway put in ``--tenant-header``;
4. the default tenant (None).

Invariant: a caller with an authenticated identity (an API key's tenant, else a
gateway header's) never leaves it by choosing a salt. A body key equal to that
tenant is the tenant; any other is nested under it, ``f"{tenant}/{salt}"``. Tenant
names have no "/", so a nested name is never another configured tenant and always
stays inside its own tenant's namespace. Without an identity the body's key is
used as given, as before tenancy.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hicache.config import ConfigError
from hicache.tenancy.names import check_tenant_name

PLAIN_PREFIX = "plain:"
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
# An HTTP header name (RFC 9110 token characters).
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


class IdentityError(Exception):
    """A request whose identity cannot be established: ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key, as key files store it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    """Key digests -> tenant names. Only digests are held: a memory dump or a leaked
    file names no usable key."""

    tenants: Mapping[str, str]

    def tenant_of(self, key: str) -> str | None:
        """The tenant of ``key``, None for an unknown key. The lookup is by digest: the
        time it takes says nothing about how close a wrong key was."""
        return self.tenants.get(key_digest(key))


def parse_api_keys(text: str, source: str) -> ApiKeys:
    """The keys of a key file's ``text``; ConfigError naming ``source:line``."""
    tenants: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        where = f"{source}:{number}"
        fields = content.split()
        if len(fields) != 2:
            raise ConfigError(f"{where}: expected '<sha256 hex of the key> <tenant>' or "
                              f"'{PLAIN_PREFIX}<key> <tenant>', got {len(fields)} fields")
        key, tenant = fields
        if key.startswith(PLAIN_PREFIX):
            plain = key[len(PLAIN_PREFIX):]
            if not plain:
                raise ConfigError(f"{where}: '{PLAIN_PREFIX}' is followed by no key")
            digest = key_digest(plain)
        elif _HEX_DIGEST.fullmatch(key):
            digest = key.lower()
        else:
            raise ConfigError(f"{where}: a key is 64 hex digits (its SHA-256) or "
                              f"'{PLAIN_PREFIX}<key>'; got a {len(key)}-character key that is "
                              "neither")
        try:
            check_tenant_name(tenant)
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        if digest in tenants:
            raise ConfigError(f"{where}: the same key as line {first_line[digest]}")
        tenants[digest] = tenant
        first_line[digest] = number
    if not tenants:
        raise ConfigError(f"{source}: no API key in the file: every request would be refused")
    return ApiKeys(tenants)


def load_api_keys(path: str | Path) -> ApiKeys:
    """``parse_api_keys`` of the file at ``path``; ConfigError when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the API key file: {error}") from None
    return parse_api_keys(text, str(path))


def check_header_name(name: str) -> str:
    """``--tenant-header``'s value, lower-cased (HTTP header names are case-blind)."""
    if not _HEADER_NAME.fullmatch(name):
        raise ConfigError(f"--tenant-header: {name!r} is not an HTTP header name")
    return name.lower()


def nested_tenant(tenant: str, body_key: str) -> str:
    """``body_key`` as a salt inside ``tenant``'s namespace (see the module docstring)."""
    return tenant if body_key == tenant else f"{tenant}/{body_key}"


def resolve_tenant(
    body_key: str | None, key_tenant: str | None, header_tenant: str | None,
) -> str | None:
    """The request's tenant (its engine ``extra_key``) by the module's precedence."""
    identity = key_tenant if key_tenant is not None else header_tenant
    if identity is None:
        return body_key
    return identity if body_key is None else nested_tenant(identity, body_key)


@dataclass(frozen=True)
class Caller:
    """A request's authenticated identity: its API key's tenant, its gateway header's."""

    key_tenant: str | None = None
    header_tenant: str | None = None

    def tenant(self, body_key: str | None) -> str | None:
        return resolve_tenant(body_key, self.key_tenant, self.header_tenant)

    @property
    def identity(self) -> str | None:
        """The tenant the caller authenticated as (its key's, else its header's), whatever
        salt its body names: what its hints' pin budgets are charged to."""
        return self.key_tenant if self.key_tenant is not None else self.header_tenant


ANONYMOUS = Caller()


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of ``Authorization: Bearer <token>``, None when there is none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(frozen=True)
class TenantIdentity:
    """A server's or router's identity settings: ``--api-keys`` and ``--tenant-header``."""

    api_keys: ApiKeys | None = None
    tenant_header: str | None = None  # lower-cased

    @property
    def enabled(self) -> bool:
        return self.api_keys is not None or self.tenant_header is not None

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """Who sent a request with these headers (case-blind, as Starlette's); raises
        IdentityError(401) for a missing or unknown API key when keys are required, and
        IdentityError(400) for a header naming no valid tenant."""
        key_tenant = None
        if self.api_keys is not None:
            token = bearer_token(headers)
            if token is None:
                raise IdentityError(401, "this server requires an API key: send "
                                    "'Authorization: Bearer <key>'")
            key_tenant = self.api_keys.tenant_of(token)
            if key_tenant is None:
                raise IdentityError(401, "unknown API key: send 'Authorization: Bearer <key>' "
                                    "with a key this server was given (--api-keys)")
        header_tenant = None
        if self.tenant_header is not None:
            value = headers.get(self.tenant_header)
            if value is not None:
                try:
                    header_tenant = check_tenant_name(value)
                except ValueError as error:
                    raise IdentityError(400, f"header {self.tenant_header}: {error}") from None
        return Caller(key_tenant, header_tenant)


def add_identity_args(group: argparse._ActionsContainer) -> None:
    """``--api-keys`` and ``--tenant-header``, for ``hicache serve`` and ``hicache router``."""
    group.add_argument(
        "--api-keys", default=None, metavar="FILE",
        help="API keys, one per line: '<sha256 hex of the key> <tenant>' or 'plain:<key> "
        "<tenant>' (# comments). With it, /generate, /v1/*, /hicache/hints, /tokenize and "
        "/detokenize need 'Authorization: Bearer <key>' (401 otherwise) and run as the key's "
        "tenant; a body's cache_salt then nests under it ('<tenant>/<salt>')",
    )
    group.add_argument(
        "--tenant-header", default=None, metavar="NAME",
        help="a header a trusted gateway sets to the request's tenant (a name of 1-128 "
        "characters of A-Z a-z 0-9 _ . : @ -); below the body's cache_salt and the API "
        "key's tenant in precedence",
    )


def identity_from_flags(api_keys: str | None, tenant_header: str | None) -> TenantIdentity:
    """The identity settings from the two flags' values; ConfigError for a bad one."""
    return TenantIdentity(
        api_keys=None if api_keys is None else load_api_keys(api_keys),
        tenant_header=None if tenant_header is None else check_header_name(tenant_header),
    )
