"""The L3 encryption key file (``--l3-encryption-keys FILE``): which keys seal whose pages.

One key per line, ``<tenant|*> <key id> <key>``::

    # tenant    key id  256-bit key, 64 hex digits or base64
    acme        1       3q2+7w...=
    acme        2       9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    *           1       1n0nZ8r0...=

Blank lines and ``#`` comments are ignored. A tenant is a cache salt
(``tenancy.names.check_tenant_name``); ``default`` names the default tenant (no
salt) and ``*`` every tenant without lines of its own. A key id is a decimal
integer in [0, 2**32), stored in every sealed page's header.

Rotation: a tenant may have several keys. The LAST line of a tenant seals what is
written from now on; all of its keys open what was written before. Deleting a key
from the file makes every page sealed under it unreadable, to every instance
that uses the file: a miss, recomputed (crypto-shredding: removing a tenant's keys
purges everything written under them from the shared store, wherever it lies).

Invariants: a ``KeyRing`` holds at least one key; a tenant's key ids are unique;
every key is 32 bytes. Any error names the file and line (``ConfigError``); the
server then refuses to start.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hicache.config import ConfigError
from hicache.tenancy.names import check_tenant_name, tenant_label

logger = logging.getLogger(__name__)

KEYS_FLAG = "--l3-encryption-keys"
# The tenant of a line that stands for every tenant without keys of its own.
EVERY_TENANT = "*"
KEY_BYTES = 32
MAX_KEY_ID = 2**32 - 1
_HEX_KEY = re.compile(r"[0-9A-Fa-f]{64}")
_HEX_DIGITS = re.compile(r"[0-9A-Fa-f]+")
_KEY_ID = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True)
class TenantKey:
    """One line of the file: a key and the id its pages carry."""

    key_id: int
    secret: bytes = field(repr=False)  # never in a log or a traceback
    line: int = 0


@dataclass(frozen=True)
class KeyRing:
    """Every tenant's keys, in file order (the last one writes). Picklable: an engine
    process builds its ciphers from it (``storage.sealing.Sealer``)."""

    source: str
    keys: Mapping[str, tuple[TenantKey, ...]]

    def keys_of(self, tenant: str | None) -> tuple[TenantKey, ...]:
        """The keys of ``tenant`` (an ``extra_key``; None: the default tenant): its own,
        else the ``*`` lines', else none (its pages are then never written to L3)."""
        own = self.keys.get(tenant_label(tenant))
        return own if own is not None else self.keys.get(EVERY_TENANT, ())

    def write_key(self, tenant: str | None) -> TenantKey | None:
        """The key that seals ``tenant``'s new pages (its last line), or None."""
        keys = self.keys_of(tenant)
        return keys[-1] if keys else None

    def read_key(self, tenant: str | None, key_id: int) -> TenantKey | None:
        """``tenant``'s key ``key_id``, or None when the file has no such key for it."""
        return next((key for key in self.keys_of(tenant) if key.key_id == key_id), None)


def load_key_file(path: str | Path) -> KeyRing:
    """Read and check a key file; ConfigError naming ``path`` (and the line) if it is bad.
    A file that other users may read is used, with a warning (keep it mode 0600)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{KEYS_FLAG}: cannot read {path}: {error}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "%s: %s is readable by other users (mode %o): anyone who can read it can read "
            "every page sealed under its keys; chmod 600 it", KEYS_FLAG, path, mode & 0o777,
        )
    return parse_key_file(text, str(path))


def parse_key_file(text: str, source: str) -> KeyRing:
    """The key ring ``text`` (a key file's content, read from ``source``) describes."""
    keys: dict[str, list[TenantKey]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        fields = line.split()
        if len(fields) != 3:
            raise ConfigError(
                f"{where}: expected '<tenant|*> <key id> <key>' (3 fields), got {len(fields)}"
            )
        tenant, key_id_text, key_text = fields
        if tenant != EVERY_TENANT:
            try:
                check_tenant_name(tenant)
            except ValueError as error:
                raise ConfigError(f"{where}: {error}") from None
        key_id = _parse_key_id(key_id_text, where)
        secret = _parse_key(key_text, where)
        tenant_keys = keys.setdefault(tenant, [])
        for earlier in tenant_keys:
            if earlier.key_id == key_id:
                raise ConfigError(
                    f"{where}: duplicate key id {key_id} for tenant {tenant!r} "
                    f"(first on line {earlier.line})"
                )
        tenant_keys.append(TenantKey(key_id, secret, number))
    if not keys:
        raise ConfigError(f"{source}: no keys (expected lines '<tenant|*> <key id> <key>')")
    return KeyRing(source, {tenant: tuple(found) for tenant, found in keys.items()})


def _parse_key_id(text: str, where: str) -> int:
    if not _KEY_ID.fullmatch(text) or int(text) > MAX_KEY_ID:
        raise ConfigError(f"{where}: a key id is an integer in [0, {MAX_KEY_ID}], got {text!r}")
    return int(text)


def _parse_key(text: str, where: str) -> bytes:
    """A 256-bit key written as 64 hex digits or as base64 (standard or URL-safe)."""
    if _HEX_KEY.fullmatch(text):
        return bytes.fromhex(text)
    if _HEX_DIGITS.fullmatch(text):  # never base64 of 32 bytes, which ends in "="
        raise ConfigError(
            f"{where}: a key is 256 bits ({KEY_BYTES * 2} hex digits), this one is "
            f"{len(text)} hex digits"
        )
    try:
        secret = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"{where}: malformed key: expected {KEY_BYTES * 2} hex digits or base64"
        ) from None
    if len(secret) != KEY_BYTES:
        raise ConfigError(
            f"{where}: a key is 256 bits ({KEY_BYTES} bytes), this one is {len(secret)} bytes"
        )
    return secret
