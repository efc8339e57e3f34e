"""KVEventsConfig: whether and where this worker publishes its KV cache events.

Parsed from ``--kv-events-config``, a JSON object with SGLang's and vLLM's keys::

    {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
     "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv-events",
     "buffer_steps": 10000, "hwm": 100000, "pin_events": false}

Off by default (``"publisher": "null"``). A key we do not know, or a value
that cannot work, is a ConfigError at start-up: a typo that silently turned
events off would leave a router routing blind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Final

from hicache.config import ConfigError

FLAG: Final = "--kv-events-config"
PUBLISHERS: Final = ("null", "zmq")
# ZMQ transports an endpoint may name (a socket binds to it).
_TRANSPORTS: Final = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where events go: a ZMQ PUB socket, a ROUTER for replays, and their limits.

    ``buffer_steps``: batches (one per scheduler step with events) kept for
    replay. ``hwm``: the PUB socket's send high-water mark (messages a slow
    subscriber may fall behind before ZMQ drops them for it). ``max_queue_size``:
    batches waiting for the publisher thread; past it the newest are dropped
    (and counted) rather than blocking the scheduler. ``pin_events``: also publish
    ``BlockPinned`` when host pages are pinned or unpinned (``hicache router`` scores
    them); off by default, as SGLang's router cannot decode a batch carrying one.
    """

    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    pin_events: bool = False

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ConfigError(
                f"{FLAG}: publisher {self.publisher!r} is not one of {', '.join(PUBLISHERS)}"
            )
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            # A wildcard port (tcp://host:*) picks a free port for each: no clash.
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
                raise ConfigError(
                    f"{FLAG}: endpoint and replay_endpoint are both {self.endpoint!r}: "
                    "they are two sockets and need two addresses"
                )
        if not isinstance(self.topic, str):
            raise ConfigError(f"{FLAG}: topic must be a string, got {self.topic!r}")
        if not isinstance(self.pin_events, bool):
            raise ConfigError(f"{FLAG}: pin_events must be true or false, got {self.pin_events!r}")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{FLAG}: {name} must be an integer >= {least}, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"


def _check_endpoint(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.startswith(_TRANSPORTS):
        raise ConfigError(
            f"{FLAG}: {name} {value!r} is not a ZMQ endpoint such as tcp://127.0.0.1:5557"
        )


_KEYS: Final = tuple(f.name for f in fields(KVEventsConfig))


def parse_kv_events_config(text: str | None) -> KVEventsConfig:
    """The config ``--kv-events-config`` names; None or empty text: events off."""
    if text is None or not text.strip():
        return KVEventsConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{FLAG}: not valid JSON ({error}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{FLAG}: expected a JSON object, got {type(raw).__name__}")
    return kv_events_config(raw)


def kv_events_config(raw: dict[str, Any]) -> KVEventsConfig:
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"{FLAG}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(_KEYS)}"
        )
    return KVEventsConfig(**raw)
