"""Where a Redis (or Valkey) L3 lives and how pages are sent to it: the redis backend's
settings, read from its extra config and checked up front.

The keys are documented in ``hicache.storage.backends.redis.backend``. Kept apart from the
backend so that a bad configuration is reported without the ``redis`` package being imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from hicache.storage.base import StorageError
from hicache.storage.options import Options

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
KNOWN_KEYS = frozenset({
    "url", "prefix", "ttl_s", "max_batch_bytes", "connect_timeout_s", "socket_timeout_s",
    "max_connections", "verify_checksum",
})


@dataclass(frozen=True)
class RedisSettings:
    """One redis backend's configuration (see ``hicache.storage.backends.redis.backend``)."""

    url: str = DEFAULT_URL
    prefix: str = DEFAULT_PREFIX
    ttl_s: float | None = None  # None: pages stay until evicted or cleared
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    verify_checksum: bool = True

    @classmethod
    def from_options(cls, options: Options) -> RedisSettings:
        options.reject_unknown(KNOWN_KEYS)
        source = options.source
        url = (options.string("url", DEFAULT_URL) or DEFAULT_URL).strip()
        scheme = urlsplit(url).scheme.lower()
        if scheme not in SCHEMES:
            raise StorageError(
                f"{source}: url must start with redis://, rediss:// (TLS) or unix://, got "
                f"{redact(url)!r} (e.g. redis://127.0.0.1:6379/0 or unix:///run/redis.sock)"
            )
        prefix = options.string("prefix", DEFAULT_PREFIX)
        assert prefix is not None
        ttl_s = options.number("ttl_s", 0.0)
        if 0 < ttl_s < 0.001:
            raise StorageError(f"{source}: ttl_s must be 0 (no expiry) or >= 0.001, got {ttl_s}")
        max_batch_bytes = options.size_bytes("max_batch_bytes", DEFAULT_MAX_BATCH_BYTES)
        if max_batch_bytes < 1:
            raise StorageError(f"{source}: max_batch_bytes must be >= 1 byte")
        connect_timeout_s = options.number("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, 0.001)
        socket_timeout_s = options.number("socket_timeout_s", DEFAULT_SOCKET_TIMEOUT_S, 0.001)
        max_connections = options.whole_number("max_connections", DEFAULT_MAX_CONNECTIONS, 1)
        return cls(
            url=url, prefix=prefix, ttl_s=ttl_s or None, max_batch_bytes=max_batch_bytes,
            connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s,
            max_connections=max_connections,
            verify_checksum=options.boolean("verify_checksum", True),
        )

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
