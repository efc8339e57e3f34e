"""Where a Mooncake client connects, and how: its settings, read from the extra config or the
environment (``MOONCAKE_*`` variables; the extra config wins) and checked up front.

The keys are documented in ``hicache.storage.backends.mooncake.backend``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.storage.base import StorageError
from hicache.storage.options import Options

DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_LOCAL_HOSTNAME = "127.0.0.1"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 2**30
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 2**20
PROTOCOLS = ("tcp", "rdma")
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")

ENV = {
    "master_server_address": ("MOONCAKE_MASTER_SERVER_ADDRESS", "MOONCAKE_MASTER"),
    "metadata_server": ("MOONCAKE_METADATA_SERVER", "MOONCAKE_TE_META_DATA_SERVER"),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME",),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
    "device_name": ("MOONCAKE_DEVICE_NAME", "MOONCAKE_DEVICE"),
}


@dataclass(frozen=True)
class MooncakeSettings:
    """How to reach the store: what a Mooncake client is set up with (one client per value)."""

    master_server_address: str
    metadata_server: str = DEFAULT_METADATA_SERVER
    protocol: str = "tcp"
    local_hostname: str = DEFAULT_LOCAL_HOSTNAME
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    device_name: str = ""

    @classmethod
    def from_options(cls, options: Options) -> MooncakeSettings:
        """Read and check the settings (extra config first, then the environment)."""
        source = options.source
        master = options.string("master_server_address", None, ENV["master_server_address"])
        if master is None:
            raise StorageError(
                f"{source}: master_server_address is required (host:port of the "
                "mooncake_master), in the extra config or MOONCAKE_MASTER_SERVER_ADDRESS"
            )
        master = master.strip()
        split_host_port(master, _where(options, "master_server_address"))
        metadata = (
            options.string("metadata_server", DEFAULT_METADATA_SERVER, ENV["metadata_server"])
            or DEFAULT_METADATA_SERVER
        ).strip()
        metadata = _check_metadata_server(metadata, _where(options, "metadata_server"))
        protocol = (options.string("protocol", "tcp", ENV["protocol"]) or "tcp").strip().lower()
        if protocol not in PROTOCOLS:
            raise StorageError(
                f"{_where(options, 'protocol')} must be one of {', '.join(PROTOCOLS)}, "
                f"got {protocol!r}"
            )
        hostname = (
            options.string("local_hostname", DEFAULT_LOCAL_HOSTNAME, ENV["local_hostname"])
            or DEFAULT_LOCAL_HOSTNAME
        ).strip()
        if not hostname or any(c.isspace() for c in hostname):
            raise StorageError(
                f"{_where(options, 'local_hostname')} must be a host name or address, "
                f"got {hostname!r}"
            )
        segment = options.size_bytes(
            "global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE, ENV["global_segment_size"]
        )
        buffer = options.size_bytes(
            "local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE, ENV["local_buffer_size"]
        )
        device = (options.string("device_name", "", ENV["device_name"]) or "").strip()
        return cls(master, metadata, protocol, hostname, segment, buffer, device)

    @property
    def master_host_port(self) -> tuple[str, int]:
        return split_host_port(self.master_server_address, "master_server_address")


def _where(options: Options, key: str) -> str:
    """Where ``key``'s value came from, for error messages (the key or its variable)."""
    return options.where(key, ENV[key])


def split_host_port(address: str, where: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; StorageError naming ``where`` otherwise."""
    host, sep, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text) if port_text.isdigit() else -1
    if not sep or not host or any(c.isspace() for c in host) or not 0 < port < 65536:
        raise StorageError(f"{where} must be host:port (e.g. 10.0.0.5:50051), got {address!r}")
    return host, port


def _check_metadata_server(value: str, where: str) -> str:
    if value.upper() == DEFAULT_METADATA_SERVER:
        return DEFAULT_METADATA_SERVER
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme.lower() not in _METADATA_SCHEMES or not rest:
            raise StorageError(
                f"{where} must be P2PHANDSHAKE or a URL with scheme "
                f"{', '.join(_METADATA_SCHEMES)}, got {value!r}"
            )
        return value
    try:  # a bare host:port is an etcd endpoint
        split_host_port(value, where)
    except StorageError:
        raise StorageError(
            f"{where} must be P2PHANDSHAKE, an http(s):// URL, etcd host:port or "
            f"redis://host:port, got {value!r}"
        ) from None
    return value
