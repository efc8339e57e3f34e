"""Where and how the lmcache backend reaches its ``lmcache_server``: its extra config, checked.

The keys are documented in ``hicache.storage.backends.lmcache.backend``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.storage.backends.lmcache.protocol import check_name_field
from hicache.storage.backends.mooncake.settings import split_host_port
from hicache.storage.base import StorageError
from hicache.storage.options import Options

# LMCache's own name for its remote server's address (its config's remote_url).
URL_ENV = ("LMCACHE_REMOTE_URL",)
URL_SCHEME = "lm://"
KNOWN_KEYS = {
    "remote_url", "namespace", "connections", "timeout_s", "connect_timeout_s",
    "retry_interval_s", "verify_checksum",
}


@dataclass(frozen=True)
class LMCacheSettings:
    host: str
    port: int
    namespace: str = "hicache"
    connections: int = 4
    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    retry_interval_s: float = 1.0
    verify_checksum: bool = True

    @classmethod
    def from_options(cls, options: Options) -> LMCacheSettings:
        options.reject_unknown(KNOWN_KEYS)
        source = options.source
        url = options.string("remote_url", None, URL_ENV)
        if url is None:
            raise StorageError(
                f"{source}: remote_url is required: the lmcache_server's address as "
                "lm://host:port (or host:port), in the extra config or LMCACHE_REMOTE_URL"
            )
        url = url.strip()
        address = url[len(URL_SCHEME):] if url.startswith(URL_SCHEME) else url
        if "://" in address:
            raise StorageError(f"{source}: remote_url must be lm://host:port, got {url!r}")
        host, port = split_host_port(address, f"{source}: remote_url")
        namespace = options.string("namespace", "hicache") or "hicache"
        try:
            check_name_field(namespace, f"{source}: namespace")
        except ValueError as error:
            raise StorageError(str(error)) from None
        connections = options.whole_number("connections", 4, minimum=1)
        return cls(
            host=host, port=port, namespace=namespace, connections=connections,
            timeout_s=_positive(options, "timeout_s", 5.0),
            connect_timeout_s=_positive(options, "connect_timeout_s", 2.0),
            retry_interval_s=options.number("retry_interval_s", 1.0),
            verify_checksum=options.boolean("verify_checksum", True),
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _positive(options: Options, key: str, default: float) -> float:
    value = options.number(key, default)
    if value <= 0:
        raise StorageError(f"{options.source}: {key} must be > 0 seconds, got {value}")
    return value
