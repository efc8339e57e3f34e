"""Where a Mooncake client connects, and how: its settings, read from the extra config or the
environment (``MOONCAKE_*`` variables; the extra config wins) and checked up front.

The keys are documented in ``hicache.storage.backends.mooncake.backend``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic.dataclasses import dataclass

from hicache.storage.base import StorageError
from hicache.storage.options import SETTINGS, Flag, FromEnv, Size, Stripped, must, text

DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_LOCAL_HOSTNAME = "127.0.0.1"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 2**30
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 2**20
PROTOCOLS = ("tcp", "rdma")
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")


def host_port(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ValueError otherwise."""
    host, sep, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text) if port_text.isdigit() else -1
    if not sep or not host or any(c.isspace() for c in host) or not 0 < port < 65536:
        raise ValueError(f"must be host:port (e.g. 10.0.0.5:50051), got {address!r}")
    return host, port


def split_host_port(address: str, where: str) -> tuple[str, int]:
    """``host_port``, its error a StorageError naming ``where``."""
    try:
        return host_port(address)
    except ValueError as error:
        raise StorageError(f"{where} {error}") from None


def _master(value: object) -> str:
    if value is None:
        raise ValueError(
            "is required (host:port of the mooncake_master), in the extra config or "
            "MOONCAKE_MASTER_SERVER_ADDRESS"
        )
    master = text(value).strip()
    host_port(master)
    return master


def _metadata_server(value: str) -> str:
    if value.upper() == DEFAULT_METADATA_SERVER:
        return DEFAULT_METADATA_SERVER
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme.lower() not in _METADATA_SCHEMES or not rest:
            raise ValueError(
                f"must be P2PHANDSHAKE or a URL with scheme {', '.join(_METADATA_SCHEMES)}, "
                f"got {value!r}"
            )
        return value
    try:  # a bare host:port is an etcd endpoint
        host_port(value)
    except ValueError:
        raise ValueError(
            "must be P2PHANDSHAKE, an http(s):// URL, etcd host:port or redis://host:port, "
            f"got {value!r}"
        ) from None
    return value


def _protocol(value: str) -> str:
    protocol = value.lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


@dataclass(frozen=True, config=SETTINGS)
class MooncakeSettings:
    """How to reach the store: what a Mooncake client is set up with (one client per value)."""

    # Required: the default None is refused.
    master_server_address: Annotated[
        str, BeforeValidator(_master), FromEnv("MOONCAKE_MASTER_SERVER_ADDRESS", "MOONCAKE_MASTER")
    ] = Field(default=None, validate_default=True)
    metadata_server: Annotated[
        Stripped, AfterValidator(_metadata_server),
        FromEnv("MOONCAKE_METADATA_SERVER", "MOONCAKE_TE_META_DATA_SERVER"),
    ] = DEFAULT_METADATA_SERVER
    protocol: Annotated[Stripped, AfterValidator(_protocol), FromEnv("MOONCAKE_PROTOCOL")] = "tcp"
    local_hostname: Annotated[
        Stripped, must(lambda host: host and not any(c.isspace() for c in host),
                       "must be a host name or address, got {!r}"),
        FromEnv("MOONCAKE_LOCAL_HOSTNAME"),
    ] = DEFAULT_LOCAL_HOSTNAME
    global_segment_size: Annotated[Size, FromEnv("MOONCAKE_GLOBAL_SEGMENT_SIZE")] = (
        DEFAULT_GLOBAL_SEGMENT_SIZE
    )
    local_buffer_size: Annotated[Size, FromEnv("MOONCAKE_LOCAL_BUFFER_SIZE")] = (
        DEFAULT_LOCAL_BUFFER_SIZE
    )
    device_name: Annotated[Stripped, FromEnv("MOONCAKE_DEVICE_NAME", "MOONCAKE_DEVICE")] = ""
    # The backend's, not the client's: left out of equality so that it does not split clients.
    verify_checksum: Flag = dataclasses.field(default=True, compare=False)

    @property
    def master_host_port(self) -> tuple[str, int]:
        return host_port(self.master_server_address)
