"""``hicache bench forward`` splits profiled time by op kind (GEMMs, attention, the rest,
and what ran outside torch's ops) and times the settings it compares in turns."""

from __future__ import annotations

import pytest

from hicache.bench.forward_profile import op_kind, shares_by_kind, timed_in_turns


def test_op_kinds() -> None:
    assert op_kind("mkldnn::_linear_pointwise") == "linear"
    assert op_kind("aten::mm") == "linear"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    # The CPU backend's prefill kernel (ctypes), named for the profiler by the backend.
    assert op_kind("hicache::attention_cpu_prefill") == "attention"
    assert op_kind("aten::scaled_dot_product_attention") == "other"  # a wrapper: ~0 self time
    assert op_kind("aten::silu") == "other"


def test_shares_are_of_the_wall_time_and_the_rest_is_outside() -> None:
    shares = shares_by_kind(
        [("mkldnn::_linear_pointwise", 0.5), ("aten::mm", 0.1),
         ("aten::_scaled_dot_product_flash_attention_for_cpu", 0.2), ("aten::add_", 0.1)],
        wall_s=1.0,
    )
    assert shares == pytest.approx(
        {"linear": 0.6, "attention": 0.2, "other": 0.1, "outside": 0.1})


def test_outside_is_never_negative() -> None:
    # Ops on worker threads can add up to more self time than the wall time.
    shares = shares_by_kind([("aten::mm", 1.5)], wall_s=1.0)
    assert shares["outside"] == 0.0 and shares["linear"] == pytest.approx(1.5)


def test_settings_are_timed_in_turns_after_a_warm_up_each() -> None:
    calls: list[str] = []
    timings = timed_in_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             repeats=2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert set(timings) == {"a", "b"}
    assert all(t.wall_s >= 0 and t.cpu_s >= 0 for t in timings.values())
