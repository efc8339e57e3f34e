"""Where a Redis (or Valkey) L3 lives and how pages are sent to it: the redis backend's
settings, read from its extra config and checked up front.

The keys are documented in ``hicache.storage.backends.redis.backend``. Kept apart from the
backend so that a bad configuration is reported without the ``redis`` package being imported.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator
from pydantic.dataclasses import dataclass

from hicache.storage.options import SETTINGS, Flag, Size, Text, TextOrDefault, must, number

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "hicache:"
# A pipeline carries at most this many bytes of pages: Redis drops a client whose
# unread input passes client-query-buffer-limit (1 GB by default), and a whole batch
# of 128 pages of 8 MiB would be 1 GiB.
DEFAULT_MAX_BATCH_BYTES = 64 * 2**20
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_SOCKET_TIMEOUT_S = 2.0
DEFAULT_MAX_CONNECTIONS = 32
SCHEMES = ("redis", "rediss", "unix")


def _url(url: str) -> str:
    url = url.strip()
    if urlsplit(url).scheme.lower() not in SCHEMES:
        raise ValueError(
            f"must start with redis://, rediss:// (TLS) or unix://, got {redact(url)!r} "
            "(e.g. redis://127.0.0.1:6379/0 or unix:///run/redis.sock)"
        )
    return url


def _ttl(ttl_s: float) -> float | None:
    if 0 < ttl_s < 0.001:
        raise ValueError(f"must be 0 (no expiry) or >= 0.001, got {ttl_s}")
    return ttl_s or None


@dataclass(frozen=True, config=SETTINGS)
class RedisSettings:
    """One redis backend's configuration (see ``hicache.storage.backends.redis.backend``)."""

    url: Annotated[TextOrDefault, AfterValidator(_url)] = DEFAULT_URL
    prefix: Text = DEFAULT_PREFIX
    # None (0 in the extra config): pages stay until evicted or cleared
    ttl_s: Annotated[float | None, number(), AfterValidator(_ttl)] = None
    max_batch_bytes: Annotated[Size, must(lambda n: n >= 1, "must be >= 1 byte")] = (
        DEFAULT_MAX_BATCH_BYTES
    )
    connect_timeout_s: Annotated[float, number(0.001)] = DEFAULT_CONNECT_TIMEOUT_S
    socket_timeout_s: Annotated[float, number(0.001)] = DEFAULT_SOCKET_TIMEOUT_S
    max_connections: Annotated[int, number(1, whole=True)] = DEFAULT_MAX_CONNECTIONS
    verify_checksum: Flag = True

    @property
    def display_url(self) -> str:
        """The url without its password (for messages and logs)."""
        return redact(self.url)


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
