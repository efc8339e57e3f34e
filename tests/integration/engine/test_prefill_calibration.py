"""A fresh engine's prefill cost measured before it serves (``prefill_calibration.py``): on
CUDA at build (tests/gpu/test_engine_gpu.py); here the same routine on the CPU engine, on
its scheduler thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from hicache.engine.cost_model import CostModel
from hicache.engine.engine import Engine
from hicache.engine.prefill_calibration import (
    MIN_TOKENS,
    PLAN,
    Calibration,
    calibrate_prefill,
    scaled_plan,
)
from tests.engine_helpers import on_scheduler, run


def test_the_plan_is_cut_to_what_fits() -> None:
    assert scaled_plan(1 << 20, 1 << 20) == list(PLAN)
    assert scaled_plan(MIN_TOKENS - 1, 1 << 20) == [] == scaled_plan(4096, MIN_TOKENS - 1)
    assert scaled_plan(4096, 300) == [(256,)]
    assert scaled_plan(4096, 1280) == [(256,), (512,), (1024, 256), (1024, 256)]
    # Chunks as the scheduler cuts them: a 4096-token prompt is two steps of 2048.
    assert scaled_plan(2048, 1 << 20) == [
        (256,), (512,), (1024, 256), (1024, 256), (2048, 512), (2048, 1024), (2048, 2048),
    ]
    assert scaled_plan(1024, 3000)[4:] == [(1024, 1024, 512), (1024, 1024), (1024, 1024)]
    for max_chunk, max_tokens in ((256, 300), (1024, 1000), (512, 2500), (2048, 5000)):
        for chunks in scaled_plan(max_chunk, max_tokens):
            assert sum(chunks) <= max_tokens and max(chunks) <= max_chunk
    # Cut at 1024 or 2048 (the CPU's and a GPU's default chunks), the fit gets eight or more.
    for max_chunk in (1024, 2048):
        chunks = [c for prompt in scaled_plan(max_chunk, 1 << 20) for c in prompt]
        assert len(chunks) - 2 >= 8


def test_calibration_seeds_the_fit_and_leaves_the_engine_as_it_was(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine("--page-size", "16", "--max-total-tokens", "16384",
                         "--chunked-prefill-size", "4096")
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    before = run(engine, prompt, max_new_tokens=8)
    scheduler = engine.scheduler
    allocator = engine.cache.device_pool.allocator
    free_before = on_scheduler(engine, lambda: allocator.num_free_pages)
    cached_before = engine.cache.tree.num_device_pages
    # A GPU's cost model: the first chunk of each kind is a warm-up, left out.
    model = CostModel(scheduler.limits.chunked_prefill_size, skip_warmup=True)
    assert model.predict_prefill(1024) is None

    calibration = cast(Calibration, on_scheduler(engine, lambda: calibrate_prefill(
        scheduler.runner, allocator, model, engine.model_config.vocab_size,
        scheduler.limits.chunked_prefill_size,
    )))
    chunks = [(context, new) for context, new, _ in calibration.steps]
    assert chunks == [(0, 256), (0, 512), (0, 1024), (1024, 256), (0, 1024), (1024, 256),
                      (0, 2048), (2048, 512), (0, 2048), (2048, 1024), (0, 4096)]
    # Cold and over a prefix: one warm-up each; the rest are the fit's samples.
    assert calibration.kept == len(chunks) - 2 == model.prefill.num_samples
    assert model.warmup_steps_skipped == 2
    predicted = model.predict_prefill(1024)
    assert predicted is not None and predicted > 0
    # Scratch pages only: every page back, nothing in the tree, the same answer again.
    assert on_scheduler(engine, lambda: allocator.num_free_pages) == free_before
    assert engine.cache.tree.num_device_pages == cached_before
    assert run(engine, prompt, max_new_tokens=8).token_ids == before.token_ids


def test_a_cpu_engine_is_not_calibrated_at_build(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--page-size", "16")
    assert engine.scheduler.cost_model.prefill.num_samples == 0
