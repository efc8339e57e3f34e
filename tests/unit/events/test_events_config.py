"""--kv-events-config: SGLang's JSON, off by default, and clear errors for what cannot work."""

from __future__ import annotations

import pytest

from hicache.config import ConfigError
from hicache.events.config import KVEventsConfig, parse_kv_events_config
from tests.engine_helpers import engine_config


def test_off_by_default() -> None:
    assert not engine_config().events.enabled
    assert not parse_kv_events_config(None).enabled
    assert not parse_kv_events_config('{"publisher": "null"}').enabled


def test_the_flag_reaches_the_engine_config() -> None:
    text = (
        '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": '
        '"tcp://127.0.0.1:5558", "topic": "kv-events", "buffer_steps": 50, "hwm": 7}'
    )
    events = engine_config("--kv-events-config", text).events
    assert events == KVEventsConfig(
        publisher="zmq", endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558", topic="kv-events", buffer_steps=50, hwm=7,
    )
    assert events.enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"publisher": "zmq", "endpiont": "tcp://127.0.0.1:1"}', "unknown key(s) 'endpiont'"),
        ('{"publisher": "kafka"}', "publisher 'kafka' is not one of null, zmq"),
        ('{"publisher": "zmq", "endpoint": "127.0.0.1:5557"}', "not a ZMQ endpoint"),
        ('{"publisher": "zmq", "replay_endpoint": 5558}', "not a ZMQ endpoint"),
        ('{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1", '
         '"replay_endpoint": "tcp://127.0.0.1:1"}', "need two addresses"),
        ('{"publisher": "zmq", "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
        ('{"publisher": "zmq", "hwm": -1}', "hwm must be an integer >= 0"),
        ('{"publisher": "zmq", "max_queue_size": "big"}', "max_queue_size must be an integer"),
        ('{"publisher": "zmq", "buffer_steps": true}', "buffer_steps must be an integer"),
        ('{"publisher": "zmq", "topic": 3}', "topic must be a string"),
    ],
)
def test_bad_configs_fail_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--kv-events-config") as error:
        parse_kv_events_config(text)
    assert message in str(error.value)


def test_a_bad_flag_fails_the_engine_config() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        engine_config("--kv-events-config", '{"publisher": "zmq", "port": 5557}')
