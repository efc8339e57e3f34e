"""``hicache router``: flags into RouterSettings, bad values refused (a start-up that refuses
mismatched workers: tests/integration/router/test_router_start_up.py)."""

from __future__ import annotations

import re

import pytest

from hicache.cli import build_parser
from hicache.router.settings import (
    DEFAULT_BOOTSTRAP_PORT,
    DecodePolicyName,
    PolicyName,
    PrefillEndpoint,
    RouterSettings,
    SettingsError,
    SharedCacheType,
    TierCostsMode,
    settings_from_args,
)


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
    assert defaults.ttft_score == "own"
    assert parse("--ttft-score", "cluster").ttft_score == "cluster"
    assert defaults.warm_on_join_timeout_s == 20.0
    assert parse("--warm-on-join-timeout-s", "0").warm_on_join_timeout_s == 0.0  # no warm


@pytest.mark.parametrize(("argv", "what"), [
    (("--worker-urls", "localhost:30000"), "http://host:port"),
    (("--worker-urls", "http://h:1/v1"), "only scheme, host and port"),
    (("--worker-urls", "http://h:x"), "invalid port"),
    (("--port", "0"), "--port"),
    (("--shared-cache-multiplier", "-0.1"), "--shared-cache-multiplier"),
    (("--overlap-weight", "-1"), "--overlap-weight"),
    (("--health-interval", "0"), "--health-interval"),
    (("--warm-on-join-timeout-s", "-1"), "--warm-on-join-timeout-s"),
    (("--warm-on-join-timeout-s", "inf"), "--warm-on-join-timeout-s"),
])
def test_bad_values_are_refused_naming_the_flag(argv: tuple[str, ...], what: str) -> None:
    with pytest.raises(SettingsError, match=what):
        parse(*argv)



def test_pd_flags_take_sglangs_url_and_optional_bootstrap_port() -> None:
    settings = parse("--pd-disaggregation", "--prefill", "http://p1:30000", "9001",
                     "--prefill", "http://p2:30000/", "--prefill", "http://p3:30000", "none",
                     "--decode", "http://d1:30000", "--decode", "http://d2:30000",
                     "--decode-policy", "round_robin", "--policy", "cache_aware")
    assert settings.pd_disaggregation is True
    assert settings.prefill == (PrefillEndpoint("http://p1:30000", 9001),
                                PrefillEndpoint("http://p2:30000", DEFAULT_BOOTSTRAP_PORT),
                                PrefillEndpoint("http://p3:30000", DEFAULT_BOOTSTRAP_PORT))
    assert settings.decode_urls == ("http://d1:30000", "http://d2:30000")
    assert settings.decode_policy is DecodePolicyName.ROUND_ROBIN
    assert settings.policy is PolicyName.CACHE_AWARE
    assert DEFAULT_BOOTSTRAP_PORT == 8998
    assert parse().decode_policy is DecodePolicyName.LEAST_LOAD


@pytest.mark.parametrize(("argv", "what"), [
    (("--prefill", "http://p:1", "--decode", "http://d:1"), "need --pd-disaggregation"),
    (("--pd-disaggregation", "--prefill", "http://p:1"), "at least one --prefill URL and one"),
    (("--pd-disaggregation", "--decode", "http://d:1"), "at least one --prefill URL and one"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "x", "--decode", "http://d:1"),
     "bootstrap port 'x' is not a number"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "70000", "--decode", "http://d:1"),
     "bootstrap port must be in 1..65535"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "1", "2", "--decode", "http://d:1"),
     "a URL and an optional bootstrap port"),
    (("--pd-disaggregation", "--prefill", "p:1", "--decode", "http://d:1"), "http://host:port"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1/x"),
     "only scheme, host and port"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://p:1"),
     "both --prefill and --decode"),
    (("--pd-disaggregation", "--prefill", "http://p:1", "1", "--prefill", "http://p:1", "2",
      "--decode", "http://d:1"), "twice with different bootstrap ports"),
    (("--pd-disaggregation", "--worker-urls", "http://w:1", "--prefill", "http://p:1",
      "--decode", "http://d:1"), "--worker-urls cannot be used"),
])
def test_bad_pd_flags_are_refused_saying_why(argv: tuple[str, ...], what: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(what)):
        parse(*argv)

