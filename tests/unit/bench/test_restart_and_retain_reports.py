"""The rolling-restart and agent-retain reports: ratios from raw counts, pass/fail rules."""

from __future__ import annotations

import pytest

from hicache.bench.agent_retain import (
    VariantRun,
    _ratio_text,
    hints_body,
    resume_ratio,
    target_met,
)
from hicache.bench.cache_tally import CacheTally
from hicache.bench.report import RequestRecord
from hicache.bench.rolling_restart import ModeRun, Restart, report_table


def tally(prompt: int, cached: int, failed: int = 0) -> CacheTally:
    return CacheTally(requests=1 + failed, failed=failed, prompt_tokens=prompt,
                      cached_tokens=cached)


def record(prompt: int, cached: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        session=0, round=1, group=0, sent_s=0.0, ok=ok, latency_s=1.0, ttft_s=0.1,
        ttft_from_content=True, itl_s=[], prompt_tokens=prompt, output_tokens=4,
        cached_tokens=cached, cached_by_tier={"device": cached, "host": 0, "storage": 0},
    )


def test_the_restart_ratio_is_of_the_windows_cached_shares() -> None:
    run = ModeRun("drain", windows={"before": tally(1000, 600), "after": tally(500, 240)},
                  restarts=[Restart(0, exit_code=0), Restart(1, exit_code=0)])
    assert run.cached_share_ratio == pytest.approx((240 / 500) / (600 / 1000))
    assert run.ok and run.to_json()["cached_share_ratio"] == run.cached_share_ratio
    assert ModeRun("drain", windows={"before": tally(0, 0), "after": tally(5, 1)}
                   ).cached_share_ratio is None
    assert run.target_met and "0.80x" in report_table([run])
    short = ModeRun("kill", windows={"before": tally(1000, 600), "after": tally(500, 200)})
    assert short.target_met is False and "NOT met" in report_table([short])


def test_a_failed_request_or_an_unclean_drain_fails_the_mode_a_killed_worker_does_not() -> None:
    failed = ModeRun("drain", windows={"restart": tally(10, 0, failed=1)})
    assert failed.failed == 1 and not failed.ok
    unclean = ModeRun("drain", restarts=[Restart(0, exit_code=0), Restart(1, exit_code=1)])
    assert not unclean.ok
    killed = ModeRun("kill", restarts=[Restart(0, exit_code=-9)])
    assert killed.ok
    assert not ModeRun("kill", error="the router did not come up").ok


def test_the_retain_ratio_is_of_the_resumes_cached_tokens_of_clean_variants() -> None:
    none = VariantRun("none", resumes=[record(100, 20), record(100, 10)])
    hints = VariantRun("hints", resumes=[record(100, 60), record(100, 30)])
    assert resume_ratio([none, hints]) == pytest.approx(90 / 30)
    assert resume_ratio([hints]) is None
    broken = VariantRun("hints", error="HTTP 400: unrecognized field 'hicache_hints'")
    assert resume_ratio([none, broken]) is None
    nothing = VariantRun("none", resumes=[record(100, 0)])
    assert resume_ratio([nothing, hints]) is None
    assert _ratio_text([nothing, hints], None) == "unbounded (90 against 0)"
    assert _ratio_text([none, hints], 3.0) == "3.00x"
    assert target_met([none, hints]) and target_met([nothing, hints])
    assert target_met([hints, VariantRun("none", resumes=[record(100, 61)])]) is False
    assert target_met([nothing, VariantRun("hints", resumes=[record(100, 0)])]) is False
    assert target_met([none, broken]) is None


def test_only_the_hints_variant_carries_a_retain_hint() -> None:
    assert hints_body("none", 60.0) is None
    assert hints_body("hints", 60.0) == {"hicache_hints": [{"kind": "retain", "ttl_s": 60.0}]}
