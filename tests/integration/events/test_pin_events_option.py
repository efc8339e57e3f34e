"""``pin_events`` in ``--kv-events-config`` reaches the engine's emitter: off by default
(the stream stays one SGLang's router decodes), on when the config says so."""

from __future__ import annotations

import json

import pytest

from hicache.engine.build import build_engine
from tests.engine_helpers import engine_config


@pytest.mark.parametrize("pin_events", [None, True])
def test_the_engines_emitter_publishes_pins_only_when_configured(pin_events: bool | None) -> None:
    events: dict[str, object] = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}
    if pin_events is not None:
        events["pin_events"] = pin_events
    engine = build_engine(engine_config(
        "--page-size", "4", "--max-total-tokens", "256", "--enable-hierarchical-cache",
        "--kv-events-config", json.dumps(events),
    ))
    try:
        emitter = engine.cache.events
        assert emitter is not None
        assert emitter.pin_events is bool(pin_events)
    finally:
        engine.shutdown()
