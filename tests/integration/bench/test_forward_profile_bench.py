"""``hicache bench forward`` computes a cold prompt in chunks over real pages, as the
scheduler's chunked prefill does: the last chunk's logits equal one step's, and the GEMM
FLOPs it counts are those of the model's projections and head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hicache.bench.forward_profile import linear_flops, prompt_chunks, weight_bytes
from hicache.cli import main
from hicache.kernels import few_rows
from tests.hf_checkpoints import variants, write_checkpoint
from tests.model_scenarios import dummy_model, new_pool, random_tokens, small_qwen3_style


def test_chunked_prompt_equals_one_step() -> None:
    model = dummy_model(small_qwen3_style())
    page_size, tokens = 4, 23
    prompt = random_tokens(tokens, model.config.vocab_size, seed=1)
    pages = torch.randperm(8)  # shuffled pages, as after cache churn
    chunked = prompt_chunks(prompt, pages, page_size, chunk=8)
    assert [step.extend_lens for step in chunked] == [(8,), (8,), (7,)]
    assert [step.seq_lens for step in chunked] == [(8,), (16,), (23,)]
    whole = prompt_chunks(prompt, pages, page_size, chunk=0)
    assert len(whole) == 1
    with torch.inference_mode():
        pool = new_pool(model, num_pages=8, page_size=page_size)
        for step in chunked:
            got = model.forward(step, pool)
        expected = model.forward(whole[0], new_pool(model, num_pages=8, page_size=page_size))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flops_and_bytes_count_projections_and_head() -> None:
    model = dummy_model(small_qwen3_style(num_layers=2))
    c = model.config
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size + \
        3 * c.intermediate_size * c.hidden_size
    head = c.vocab_size * c.hidden_size
    assert linear_flops(model, tokens=5, logit_rows=1) == 2.0 * (2 * per_layer * 5 + head)
    assert weight_bytes(model) == 4 * (2 * per_layer + head)  # float32


def test_flops_and_bytes_survive_the_release_of_the_plain_weights() -> None:
    model = dummy_model(small_qwen3_style(num_layers=2))
    before = (linear_flops(model, tokens=5, logit_rows=1), weight_bytes(model))
    if few_rows._library() is None:
        pytest.skip("no C++ compiler for the few-row kernel")
    assert model.prepack_weights(one_row="blocked") and model.plain_weights_released
    assert (linear_flops(model, tokens=5, logit_rows=1), weight_bytes(model)) == before


def test_decode_steps_over_blocked_and_packed_weights_in_turns(tmp_path: Path) -> None:
    if few_rows._library() is None:
        pytest.skip("no C++ compiler for the few-row kernel")
    model_dir = tmp_path / "model"
    write_checkpoint(variants()["llama-gqa"], model_dir)
    out = tmp_path / "forward.json"
    code = main(["bench", "forward", "--model-path", str(model_dir), "--prompt", "16",
                 "--chunk", "0", "--batch", "2", "--context", "8", "--repeats", "1",
                 "--few-rows", "compare", "--json", str(out)])
    assert code == 0
    cases = [r["case"] for r in json.loads(out.read_text())["results"]]
    assert len(cases) == 3 and cases[0].startswith("cold prompt 16")
    assert "over blocked weights" in cases[1] and "over packed weights" in cases[2]


def test_decode_steps_alone_over_contexts_longer_than_the_prompt(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_checkpoint(variants()["llama-gqa"], model_dir)
    out = tmp_path / "forward.json"
    code = main(["bench", "forward", "--model-path", str(model_dir), "--prompt", "0",
                 "--batch", "2", "--context", "24", "--repeats", "1", "--json", str(out)])
    assert code == 0
    cases = [r["case"] for r in json.loads(out.read_text())["results"]]
    assert len(cases) == 1 and cases[0].startswith("decode B=2 context 24 ")
