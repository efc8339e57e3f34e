"""Disaggregation settings: which side this instance is, and how it moves KV."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hicache.config import ConfigError

# SGLang's default bootstrap port.
DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


class DisaggregationMode(str, Enum):
    NULL = "null"  # a plain instance: prefill and decode
    PREFILL = "prefill"  # prompts only; their KV goes to a decode instance
    DECODE = "decode"  # generation from KV a prefill instance sent


class TransferBackend(str, Enum):
    MOONCAKE = "mooncake"


@dataclass(frozen=True)
class DisaggregationConfig:
    mode: DisaggregationMode = DisaggregationMode.NULL
    transfer_backend: TransferBackend = TransferBackend.MOONCAKE
    # Prefill only: where decode instances register their rooms (HTTP).
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    # The address peers reach this instance's bootstrap server and transfer engine at.
    host: str = "127.0.0.1"
    # A request whose KV has not landed this long after the handshake began fails.
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    # Decode only: finished requests' KV goes to the radix tree (so L2 and L3 back it up).
    decode_offload_kvcache: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.bootstrap_port < 65536:
            raise ConfigError(
                f"--disaggregation-bootstrap-port must be in 1..65535, got {self.bootstrap_port}"
            )
        if not self.transfer_timeout_s > 0:
            raise ConfigError(
                f"--disaggregation-transfer-timeout-s must be > 0, got {self.transfer_timeout_s}"
            )
        if self.decode_offload_kvcache and self.mode is not DisaggregationMode.DECODE:
            raise ConfigError(
                "--disaggregation-decode-enable-offload-kvcache needs --disaggregation-mode decode"
            )

    @property
    def enabled(self) -> bool:
        return self.mode is not DisaggregationMode.NULL
