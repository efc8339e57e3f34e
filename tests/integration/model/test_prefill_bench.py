"""``hicache bench prefill`` on CPU with the tiny preset, and the transformers twin it times.

The twin must hold our weight tensors themselves (no copy) and compute our
logits; the command must run end to end, print its table and write its JSON.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hicache.bench.prefill import transformers_twin
from hicache.cli import main
from hicache.model.config import ModelConfig
from hicache.model.model import CausalLM
from hicache.model.presets import get_preset
from tests.model_scenarios import (
    SlotAllocator,
    dummy_model,
    new_pool,
    random_tokens,
    run_in_steps,
    small_qwen3_style,
)

QWEN3_STYLE = small_qwen3_style(num_layers=2)
LLAMA3_STYLE = dataclasses.replace(
    get_preset("llama3-8b"),
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    dtype=torch.float32,
)


@pytest.mark.parametrize("config", [QWEN3_STYLE, LLAMA3_STYLE], ids=["qwen3", "llama3"])
def test_twin_shares_our_weights_and_computes_our_logits(config: ModelConfig) -> None:
    model: CausalLM = dummy_model(config)
    twin = transformers_twin(model)
    ours = model.hf_weights()
    theirs = dict(twin.named_parameters(remove_duplicate=False))
    for name, tensor in ours.items():
        assert theirs[name].data_ptr() == tensor.data_ptr(), name  # the same memory
    if config.tie_word_embeddings:
        assert theirs["lm_head.weight"].data_ptr() == model.embed_tokens.data_ptr()

    prompt = random_tokens(40, config.vocab_size, seed=1)
    pool = new_pool(model)
    got = run_in_steps(model, pool, prompt, SlotAllocator(pool).slots(40), [40])
    with torch.inference_mode():
        expected = twin(input_ids=torch.tensor([prompt])).logits[0]
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_bench_prefill_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str
) -> None:
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--device", device, "--preset", "tiny", "--tokens", "8,33"]
    rc = main([*argv, "--repeats", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| tokens |")
    assert [row.split("|")[1].strip() for row in table[1:]] == ["8", "33"]

    results = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in results] == [8, 33]
    for r in results:
        assert len(r["ours_samples_s"]) == len(r["hf_samples_s"]) == 2
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["hf_median_s"] / r["ours_median_s"])
        # float32, same weights: the two models agree on the prompt's next-token logits
        # (on CUDA up to the different kernels' summation orders).
        assert r["max_abs_logit_diff"] < (1e-4 if device == "cpu" else 1e-3)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokens", "9000"], "max_position_embeddings"),
        (["--tokens", "8,x"], "comma-separated integers"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bench_prefill_refuses_bad_arguments(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "prefill", "--device", "cpu", "--preset", "tiny", *extra]) == 2
    assert message in capsys.readouterr().err
