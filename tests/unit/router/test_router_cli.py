"""``hicache router``: flags into RouterSettings, bad values refused, and a start-up that
refuses mismatched workers exits 2 naming both values."""

from __future__ import annotations

import logging

import pytest

from hicache.cli import build_parser
from hicache.router.serve import main as router_main
from hicache.router.settings import (
    PolicyName,
    RouterSettings,
    SettingsError,
    SharedCacheType,
    TierCostsMode,
    settings_from_args,
)
from tests.unit.router.fakes import DictIndex, FakeWorker, FirstPolicy, fake_workers


def parse(*argv: str) -> RouterSettings:
    return settings_from_args(build_parser().parse_args(["router", *argv]))


def test_flags_become_settings() -> None:
    settings = parse(
        "--worker-urls", "http://a:1/", "http://b:2", "http://a:1", "--port", "9000",
        "--policy", "cache_aware", "--overlap-weight", "2", "--shared-cache-multiplier", "0.5",
        "--shared-cache-type", "hicache", "--tier-costs", "measured", "--tokenizer", "/tok",
        "--admin-api-key", "k", "--health-interval", "0.5", "--request-timeout", "30",
    )
    assert settings == RouterSettings(
        worker_urls=("http://a:1", "http://b:2"), port=9000, policy=PolicyName.CACHE_AWARE,
        overlap_weight=2.0, shared_cache_multiplier=0.5,
        shared_cache_type=SharedCacheType.HICACHE, tier_costs=TierCostsMode.MEASURED,
        tokenizer="/tok", admin_api_key="k", health_interval_s=0.5, request_timeout_s=30.0,
    )
    assert settings.public()["admin_api_key"] is True  # never the key itself
    defaults = parse()
    assert defaults.policy is PolicyName.TIER_AWARE
    assert defaults.shared_cache_multiplier == 0.0
    assert defaults.shared_cache_type is SharedCacheType.NONE
    assert parse("--admin-api-key", "").admin_api_key is None


@pytest.mark.parametrize(("argv", "what"), [
    (("--worker-urls", "localhost:30000"), "http://host:port"),
    (("--worker-urls", "http://h:1/v1"), "only scheme, host and port"),
    (("--worker-urls", "http://h:x"), "invalid port"),
    (("--port", "0"), "--port"),
    (("--shared-cache-multiplier", "-0.1"), "--shared-cache-multiplier"),
    (("--overlap-weight", "-1"), "--overlap-weight"),
    (("--health-interval", "0"), "--health-interval"),
])
def test_bad_values_are_refused_naming_the_flag(argv: tuple[str, ...], what: str) -> None:
    with pytest.raises(SettingsError, match=what):
        parse(*argv)


def test_start_up_with_mismatched_workers_exits_2_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def factories() -> tuple[object, object]:
        return DictIndex, lambda index, settings, workers, costs: FirstPolicy(index)

    with fake_workers(FakeWorker(page_size=4), FakeWorker(page_size=32)) as (a, b):
        args = build_parser().parse_args(
            ["router", "--worker-urls", a, b, "--worker-startup-timeout", "5"])
        with caplog.at_level(logging.ERROR):
            assert router_main(args, factories()) == 2
    assert f"{b} has page size 32, but {a} has page size 4" in caplog.text
    args = build_parser().parse_args(["router", "--port", "70000"])
    assert router_main(args, factories()) == 2
