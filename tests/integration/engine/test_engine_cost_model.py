"""The engine's live cost model learns from what it serves: its prefill estimate from its
own forward steps, the host->device load and the L3 read from its own loads and reads."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from hicache.engine.engine import Engine
from tests.engine_helpers import on_scheduler, run

PAGE = 16
# Prompt lengths within one chunk of the CPU's chunked prefill (256): one step each.
SIZES = (48, 96, 160, 240)
CHECKED = 200


def ids(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=generator).tolist()


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    """The prefill step time the engine measured for ``prompt`` (one step, one token out)."""
    before = engine.metrics()["engine_prefill_step_seconds"]
    run(engine, prompt, max_new_tokens=1)
    return engine.metrics()["engine_prefill_step_seconds"] - before


def test_prefill_estimate_is_fit_from_the_engine_steps(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine("--page-size", str(PAGE), "--max-total-tokens", "4096")
    model = engine.scheduler.cost_model
    assert on_scheduler(engine, lambda: model.predict_prefill(CHECKED)) is None  # unknown yet
    assert "cost_prefill_coef_step_seconds" not in engine.metrics()
    seed = 0
    for _ in range(3):
        for size in SIZES:
            seed += 1
            run(engine, ids(seed, size), max_new_tokens=1)
    measured = statistics.median(prefill_seconds(engine, ids(1000 + i, CHECKED))
                                 for i in range(5))
    predicted = on_scheduler(engine, lambda: model.predict_prefill(CHECKED))
    assert isinstance(predicted, float) and predicted > 0
    # Broad: the machine may be busy with other work while the samples are taken.
    assert 0.2 * measured <= predicted <= 5 * measured, (predicted, measured)
    numbers = engine.metrics()
    assert numbers["cost_prefill_samples"] >= 12
    for tokens in (1024, 4096, 16384):
        assert numbers[f"cost_prefill_seconds_per_token_context_{tokens}"] > 0


def test_l2_load_and_l3_read_estimates_come_from_loads_and_prefetches(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    config = {"path": str(tmp_path / "l3"), "prefetch_threshold": PAGE}
    engine = make_engine(
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
        "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(config),
    )
    assert engine.cache.storage is not None, engine.cache.storage_error
    prompts = [ids(seed, 200) for seed in range(4)]
    for prompt in prompts:
        run(engine, prompt, max_new_tokens=2)
    numbers = engine.metrics()
    assert "cost_l3_read_latency_seconds_backend_file" not in numbers  # nothing read yet
    assert numbers["cost_l3_read_samples_backend_file"] == 0
    assert engine.flush_cache()  # the KV is in L3 alone now
    for prompt in prompts:
        out = run(engine, prompt, max_new_tokens=2)
        assert out.last.cached_tokens.storage > 0, out.last.cached_tokens
    numbers = engine.metrics()
    # Every L3 hit was read into host memory, then loaded to the device.
    assert numbers["cost_l3_read_samples_backend_file"] >= 3
    assert numbers["cost_l3_read_reference_seconds_backend_file"] > 0
    assert numbers["cost_l3_read_latency_seconds_backend_file"] >= 0
    assert numbers["cost_l2_load_samples"] >= 3
    assert numbers["cost_l2_load_reference_seconds"] > 0
    read = engine.cache.storage.read_time
    predicted = on_scheduler(engine, lambda: read.predict_read(12))
    assert isinstance(predicted, float) and predicted > 0
