"""Where and how the lmcache backend reaches its ``lmcache_server``: its extra config, checked.

The keys are documented in ``hicache.storage.backends.lmcache.backend``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass

from hicache.storage.backends.lmcache.protocol import check_name_field
from hicache.storage.backends.mooncake.settings import host_port
from hicache.storage.options import SETTINGS, Flag, FromEnv, TextOrDefault, must, number, text

URL_SCHEME = "lm://"


def _remote_url(value: object) -> str:
    """The server's host:port, from lm://host:port or host:port."""
    if value is None:
        raise ValueError(
            "is required: the lmcache_server's address as lm://host:port (or host:port), "
            "in the extra config or LMCACHE_REMOTE_URL"
        )
    url = text(value).strip()
    address = url.removeprefix(URL_SCHEME)
    if "://" in address:
        raise ValueError(f"must be lm://host:port, got {url!r}")
    host_port(address)
    return address


Seconds = Annotated[float, number(), must(lambda s: s > 0, "must be > 0 seconds, got {}")]


@dataclass(frozen=True, config=SETTINGS)
class LMCacheSettings:
    # Required (the default None is refused); LMCACHE_REMOTE_URL is LMCache's own name
    # for it (its config's remote_url). Held as host:port.
    remote_url: Annotated[
        str, BeforeValidator(_remote_url), FromEnv("LMCACHE_REMOTE_URL", name_variable=False)
    ] = Field(default=None, validate_default=True)
    namespace: TextOrDefault = "hicache"
    connections: Annotated[int, number(1, whole=True)] = 4
    timeout_s: Seconds = 5.0
    connect_timeout_s: Seconds = 2.0
    retry_interval_s: Annotated[float, number()] = 1.0
    verify_checksum: Flag = True

    @model_validator(mode="after")
    def _namespace_fits_a_key(self) -> LMCacheSettings:
        check_name_field(self.namespace, "namespace")
        return self

    @property
    def address(self) -> str:
        return self.remote_url

    @property
    def host(self) -> str:
        return host_port(self.remote_url)[0]

    @property
    def port(self) -> int:
        return host_port(self.remote_url)[1]
