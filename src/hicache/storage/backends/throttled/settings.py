"""The throttled backend's settings: which backend it wraps, that backend's own extra
config, and the latency and bandwidth each direction is held to.

Kept apart from the backend (and free of torch) so that a bad configuration is reported
before anything is created. The keys are documented in
``hicache.storage.backends.throttled.backend``.

Invariants: latencies are >= 0 milliseconds; a bandwidth is a size per second > 0, or None
for no limit; the wrapped backend is another registered one (not ``throttled`` itself: a
throttle of a throttle is one throttle with the delays added up, so it is refused as a
likely mistake).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic.dataclasses import dataclass

from hicache.storage.options import SETTINGS, Size, must, number, text
from hicache.storage.registry import BACKENDS

NAME = "throttled"


def _inner_name(value: object) -> str:
    choices = ", ".join(sorted(set(BACKENDS) - {NAME}))
    if value is None:
        raise ValueError(f"is required: the name of the backend to wrap, one of: {choices}")
    name = text(value).strip().lower()
    if name == NAME:
        raise ValueError(f"must name the backend to wrap, not {NAME!r} itself; one of: {choices}")
    if name not in BACKENDS:
        raise ValueError(f"must name an L3 storage backend to wrap ({choices}), got {name!r}")
    return name


def _mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(
            f"must be the wrapped backend's extra config (an object), got {value!r}"
        )
    return dict(value)


Bandwidth = Annotated[
    Size, must(lambda n: n > 0, "must be > 0 bytes per second (null: no limit), got {!r}")
]
Milliseconds = Annotated[float, number()]


@dataclass(frozen=True, config=SETTINGS)
class ThrottledSettings:
    """One throttled backend's configuration (see the module docstring)."""

    # Required (the default None is refused).
    backend: Annotated[str, BeforeValidator(_inner_name)] = Field(
        default=None, validate_default=True
    )
    backend_extra: Annotated[dict[str, Any], BeforeValidator(_mapping)] = Field(
        default_factory=dict
    )
    read_latency_ms: Milliseconds = 0.0
    read_bandwidth: Bandwidth | None = None
    write_latency_ms: Milliseconds = 0.0
    write_bandwidth: Bandwidth | None = None
