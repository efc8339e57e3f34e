"""The engine on CUDA: L1, L2 and L3 hits equal cold for every layout and io backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.engine.engine import Engine
from tests.unit.engine.test_engine_cache_reuse import check_tiers_equal_cold, l3_flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiers_equal_cold_on_cuda(
    make_engine: Callable[..., Engine], tmp_path: Path, layout: str, io: str, dtype: str
) -> None:
    engine = make_engine(*l3_flags(tmp_path / "l3", layout, io), "--device", "cuda",
                         "--dtype", dtype)
    assert engine.cache.device_pool.device.type == "cuda"
    # Same KV in, same suffix computed: tokens must match exactly; logits to the
    # precision of the dtype (cold is one long prefill, the hits a short one).
    check_tiers_equal_cold(engine, tolerance=1e-4 if dtype == "float32" else 5e-2)
