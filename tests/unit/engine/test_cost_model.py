"""The engine's cost model flattens its estimates into ``cost_*`` numbers, and the server's
``cost_model`` block reads them back: unknown estimates stay None, never guessed."""

from __future__ import annotations

import pytest

from hicache.engine.cost_model import REFERENCE_PAGES, CostModel
from hicache.estimators import attention_pairs
from hicache.server.cost_model_info import cost_model_description
from hicache.storage.bandwidth import ReadTimeEstimate

PAGE_BYTES = 1 << 16


def learned() -> tuple[CostModel, ReadTimeEstimate]:
    model = CostModel(chunk_tokens=1024)
    for new in (64, 128, 256, 512, 1024, 96, 192, 384, 768):
        model.observe_step(new, attention_pairs(new, 0), 0, 0.001 + 1e-5 * new)
    model.observe_loads([(4, 0.0005 + 4e-5), (16, 0.0005 + 16e-5), (64, 0.0005 + 64e-5)])
    read = ReadTimeEstimate(page_size=16, page_bytes=PAGE_BYTES)
    for pages in (2, 8, 32):
        read.observe(pages, 0.002 + pages * PAGE_BYTES / 1e8)
    return model, read


def test_a_fresh_model_says_unknown() -> None:
    model = CostModel()
    read = ReadTimeEstimate(page_size=16, page_bytes=PAGE_BYTES)
    numbers = model.metrics({"file": read})
    assert numbers == {"cost_prefill_samples": 0.0, "cost_l2_load_samples": 0.0,
                       "cost_l3_read_samples_backend_file": 0.0}
    block = cost_model_description(numbers)
    assert block is not None
    assert block["prefill"]["coefficients"] is None
    assert set(block["prefill"]["cold_prefill_seconds"].values()) == {None}
    assert block["l2_load"]["reference_load_seconds"] is None
    assert block["l3"]["file"] == {"samples": 0, "latency_seconds": None,
                                   "bandwidth_bytes_per_second": None,
                                   "reference_read_seconds": None}
    assert model.predict_prefill(100) is None


def test_learned_numbers_and_their_block() -> None:
    model, read = learned()
    numbers = model.metrics({"file": read})
    # 16K tokens cold is 16 chunks of 1024: 16 steps' fixed cost and 16K tokens.
    assert numbers["cost_prefill_seconds_per_token_context_16384"] == pytest.approx(
        (16 * 0.001 + 1e-5 * 16384) / 16384, rel=1e-3)
    assert numbers["cost_l2_load_seconds_per_page"] == pytest.approx(1e-5, rel=1e-3)
    assert numbers["cost_l2_load_reference_seconds"] == pytest.approx(
        0.0005 + REFERENCE_PAGES * 1e-5, rel=1e-3)
    assert numbers["cost_l3_read_bandwidth_bytes_per_second_backend_file"] == pytest.approx(
        1e8, rel=1e-3)
    block = cost_model_description(numbers)
    assert block is not None
    assert block["prefill"]["samples"] == 9
    assert block["prefill"]["cold_prefill_seconds"]["1024"] == pytest.approx(
        0.001 + 1e-5 * 1024, rel=1e-3)
    assert block["l3"]["file"]["latency_seconds"] == pytest.approx(0.002, rel=1e-3)
    assert block["l3"]["file"]["reference_read_seconds"] == pytest.approx(
        0.002 + REFERENCE_PAGES * PAGE_BYTES / 1e8, rel=1e-3)


def test_no_block_from_an_engine_without_a_cost_model() -> None:
    assert cost_model_description({"engine_num_steps": 3.0}) is None


def test_on_a_gpu_the_first_step_of_each_kind_is_a_warm_up_left_out() -> None:
    model = CostModel(chunk_tokens=1024, skip_warmup=True)
    # cold, over a cached prefix, cold beside decodes, prefix beside decodes: four kinds.
    kinds = [(256, attention_pairs(256, 0), 0), (256, attention_pairs(256, 512), 0),
             (256, attention_pairs(256, 0), 3), (256, attention_pairs(256, 512), 3)]
    for new, pairs, rows in kinds:
        assert not model.observe_step(new, pairs, rows, 10.0)  # compiling: seconds, not ms
        assert model.observe_step(new, pairs, rows, 0.003)
    assert model.warmup_steps_skipped == 4
    assert model.prefill.num_samples == 4
    for new in (64, 128, 512, 1024, 96):
        assert model.observe_step(new, attention_pairs(new, 0), 0, 0.001 + 1e-5 * new)
    # No 10 s sample in the fit: a 2K-token cold prompt is predicted in milliseconds.
    predicted = model.predict_prefill(2048)
    assert predicted is not None and predicted < 0.1


def test_on_a_cpu_every_step_counts() -> None:
    model = CostModel(chunk_tokens=1024)
    assert model.observe_step(256, attention_pairs(256, 0), 0, 0.003)
    assert model.warmup_steps_skipped == 0 and model.prefill.num_samples == 1
