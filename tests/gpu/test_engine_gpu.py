"""The engine on CUDA: L1, L2 and L3 hits equal cold for every layout and io backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.engine.engine import Engine
from tests.integration.engine.test_engine_cache_reuse import check_tiers_equal_cold, l3_flags

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager(make_engine: Callable[..., Engine], dtype: str) -> None:
    from hicache.engine.api import GenerateRequest, SamplingParams
    from tests.engine_helpers import run, run_many

    flags = ("--device", "cuda", "--model-preset", "tiny", "--dtype", dtype,
             "--max-running-requests", "8")
    graphs = make_engine(*flags)
    eager = make_engine(*flags, "--disable-cuda-graph")
    recorded = graphs.scheduler.runner.decode_graphs
    assert recorded is not None, "the engine recorded no CUDA graphs"
    assert recorded.buckets == (1, 2, 3, 4, 6, 8)
    assert eager.scheduler.runner.decode_graphs is None
    params = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True)
    prompts = [GenerateRequest(tuple(range(3 + i, 20 + 7 * i)), params) for i in range(5)]
    together = [r.token_ids for r in run_many(graphs, prompts)]
    alone = run(graphs, list(range(40, 75)), logits=True, max_new_tokens=9, ignore_eos=True)
    assert together == [r.token_ids for r in run_many(eager, prompts)]
    reference = run(eager, list(range(40, 75)), logits=True, max_new_tokens=9, ignore_eos=True)
    assert alone.token_ids == reference.token_ids
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(alone.logits, reference.logits, strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
    assert recorded.replays[6] >= 1 and recorded.replays[1] >= 8, recorded.replays
    graphs.check_integrity()


def test_the_cost_model_leaves_out_each_kind_of_steps_first_on_cuda(
    make_engine: Callable[..., Engine],
) -> None:
    from tests.engine_helpers import run

    engine = make_engine("--device", "cuda", "--model-preset", "tiny")
    model = engine.scheduler.cost_model
    assert model.skip_warmup
    # The build calibrated the fit (prefill_calibration.py): its first cold chunk and its
    # first chunk over a prefix compiled the kernels and were left out, the rest kept.
    assert model.warmup_steps_skipped == 2
    calibrated = model.prefill.num_samples
    assert calibrated >= 8 and model.predict_prefill(1024) is not None
    run(engine, list(range(3, 40)), max_new_tokens=2)
    run(engine, list(range(50, 90)), max_new_tokens=2)
    # Requests' cold steps are of a kind seen already: both count.
    assert model.warmup_steps_skipped == 2
    assert model.prefill.num_samples == calibrated + 2
