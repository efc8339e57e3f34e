"""``hicache bench forward`` splits profiled time by op kind: GEMMs, attention, the rest,
and what ran outside torch's ops."""

from __future__ import annotations

import pytest

from hicache.bench.forward_profile import op_kind, shares_by_kind


def test_op_kinds() -> None:
    assert op_kind("mkldnn::_linear_pointwise") == "linear"
    assert op_kind("aten::mm") == "linear"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
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
