"""L3 flags, the extra-config document, and the circuit breaker's state machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hicache.config import ConfigError
from hicache.server.args import add_storage_args, storage_config_from_args
from hicache.storage.breaker import BreakerState, CircuitBreaker
from hicache.storage.config import PrefetchPolicy, StorageConfig, load_extra_config


def parse(*argv: str) -> StorageConfig:
    parser = argparse.ArgumentParser()
    add_storage_args(parser)
    return storage_config_from_args(parser.parse_args(list(argv)))


def test_defaults_mean_no_l3_and_a_bounded_prefetch_wait() -> None:
    config = parse()
    assert not config.enabled
    assert config.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert (config.prefetch_threshold, config.prefetch_timeout_base) == (256, 2.0)
    assert (config.prefetch_timeout_per_ki_token, config.prefetch_timeout_max) == (0.1, 30.0)


def test_extra_config_splits_cache_keys_from_backend_keys() -> None:
    config = parse(
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "timeout",
        "--hicache-storage-backend-extra-config",
        '{"prefetch_threshold": 64, "prefetch_timeout_base": 1, "path": "/tmp/l3", "x": [1]}',
    )
    assert config.backend == "file" and config.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert config.prefetch_threshold == 64 and config.prefetch_timeout_base == 1
    assert dict(config.backend_extra) == {"path": "/tmp/l3", "x": [1]}
    # base + per-KiB x tokens, capped
    assert config.prefetch_timeout(2048) == pytest.approx(1.2)
    assert StorageConfig(prefetch_timeout_max=0.5).prefetch_timeout(10**6) == 0.5


@pytest.mark.parametrize(("value", "expected"), [
    ('"auto"', "auto"), ('" Auto "', "auto"), ("0", 0.0), ("0.25", 0.25), ("3", 3.0),
])
def test_the_per_ki_token_allowance_is_auto_or_a_number(value: str, expected: object) -> None:
    config = parse("--hicache-storage-backend-extra-config",
                   f'{{"prefetch_timeout_per_ki_token": {value}}}')
    assert config.prefetch_timeout_per_ki_token == expected
    assert config.auto_prefetch_timeout == (expected == "auto")
    assert "prefetch_timeout_per_ki_token" not in config.backend_extra


@pytest.mark.parametrize("value", ['"fast"', '""', "-0.5", "NaN", "Infinity", "true", "[1]"])
def test_a_bad_per_ki_token_allowance_names_the_choices(value: str) -> None:
    with pytest.raises(ConfigError, match=r'prefetch_timeout_per_ki_token must be "auto" or'):
        parse("--hicache-storage-backend-extra-config",
              f'{{"prefetch_timeout_per_ki_token": {value}}}')
    with pytest.raises(ConfigError, match=r'prefetch_timeout_per_ki_token must be "auto" or'):
        StorageConfig(prefetch_timeout_per_ki_token=json.loads(value))


@pytest.mark.parametrize(
    ("suffix", "body"),
    [
        (".json", '{"prefetch_threshold": 32, "master": "127.0.0.1:1"}'),
        (".toml", 'prefetch_threshold = 32\nmaster = "127.0.0.1:1"\n'),
    ],
)
def test_extra_config_from_a_file(tmp_path: Path, suffix: str, body: str) -> None:
    path = tmp_path / f"l3{suffix}"
    path.write_text(body)
    config = parse("--hicache-storage-backend-extra-config", f"@{path}")
    assert config.prefetch_threshold == 32
    assert dict(config.backend_extra) == {"master": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
        ('{"prefetch_threshold": "64"}', "prefetch_threshold must be an integer"),
        ('{"prefetch_threshold": true}', "prefetch_threshold must be an integer"),
        ('{"prefetch_timeout_max": "soon"}', "prefetch_timeout_max must be a number"),
        ('{"prefetch_threshold": -1}', "prefetch_threshold must be >= 0"),
        ('{"prefetch_max_host_fraction": 2}', "prefetch_max_host_fraction"),
        ('{"io_timeout_s": 0}', "io_timeout_s must be a finite number > 0"),
        ('{"io_timeout_s": "10s"}', "io_timeout_s must be a number"),
        ("@/nonexistent/l3.json", "cannot read"),
    ],
)
def test_bad_extra_config_fails_with_a_message(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse("--hicache-storage-backend-extra-config", text)


def test_bad_files_and_policies(tmp_path: Path) -> None:
    odd = tmp_path / "l3.ini"
    odd.write_text("x=1")
    with pytest.raises(ConfigError, match=r"\.json, \.toml or \.yaml"):
        load_extra_config(f"@{odd}")
    broken = tmp_path / "l3.toml"
    broken.write_text("= nope")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_extra_config(f"@{broken}")
    with pytest.raises(ConfigError, match="--hicache-storage-prefetch-policy"):
        StorageConfig(prefetch_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # argparse rejects an unknown backend name
        parse("--hicache-storage-backend", "tape")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_backs_off() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=2, backoff_base=1.0, backoff_max=3.0, clock=clock)
    breaker.record_failure("x")
    breaker.record_success()  # a success resets the count
    breaker.record_failure("x")
    assert breaker.allow() and breaker.state is BreakerState.CLOSED
    breaker.record_failure("x")
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the one trial call
    assert not breaker.allow()  # nobody else while it runs
    breaker.record_failure("still down")  # backoff doubles: 2 s
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()
    breaker.record_failure("still down")  # 4 s, capped at 3 s
    clock.now += 3.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.num_opened == 3 and breaker.num_refused == 3


def test_a_hung_call_trips_the_breaker_at_once() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=3, backoff_base=1.0, backoff_max=8.0, clock=clock)
    breaker.trip("get gave no answer")  # no need for three failures: a hang is an outage
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the trial
    breaker.trip("still hung")  # a hung trial doubles the backoff, as a failed one does
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
