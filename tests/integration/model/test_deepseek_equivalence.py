"""DeepSeek-V2/V3 (MLA + MoE) compute what transformers computes, from the same checkpoint.

Each variant (``deepseek_checkpoints``) is written by transformers' ``save_pretrained``
and read back by ``load_model``. In float32 on CPU, through the paged latent pool:
a cold prefill, a prefill on a cached prefix, token-by-token decode, greedy decode
of two sequences batched and a mixed step equal transformers' logits to 1e-4, with
MLA attention in the expanded form, the absorbed form, and the per-step choice.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from hicache.model.batch import ForwardBatch
from hicache.model.config import Architecture
from hicache.model.loader import load_model
from hicache.model.mla_step import MLAForm
from hicache.model.model import CausalLM
from tests.deepseek_checkpoints import deepseek_variants, write_deepseek
from tests.hf_checkpoints import VOCAB, Checkpoint, hf_greedy_decode, hf_logits
from tests.model_scenarios import SlotAllocator, new_pool, random_tokens, run_in_steps

VARIANTS = deepseek_variants()
TOL = {"atol": 1e-4, "rtol": 1e-5}
PROMPT_LEN = 41  # past the YaRN variants' original context (32)
PAGE_SIZE = 4


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    return write_deepseek(VARIANTS[request.param], tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ours(checkpoint: Checkpoint) -> CausalLM:
    return load_model(checkpoint.path, "auto", None, "float32", "cpu").model


@pytest.fixture(params=list(MLAForm))
def form(request: pytest.FixtureRequest, ours: CausalLM) -> Iterator[MLAForm]:
    ours.mla_form = request.param
    yield request.param
    ours.mla_form = MLAForm.AUTO


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return random_tokens(length, VOCAB, seed)


def test_config_is_read_as_written(checkpoint: Checkpoint, ours: CausalLM) -> None:
    hf = checkpoint.hf.config
    config = ours.config
    assert config.architecture is Architecture(hf.architectures[0])
    assert config.mla is not None and config.moe is not None
    assert config.mla.q_lora_rank == hf.q_lora_rank
    assert config.mla.latent_dim == hf.kv_lora_rank + hf.qk_rope_head_dim
    assert config.moe.num_routed_experts == hf.n_routed_experts
    assert config.moe.first_k_dense_replace == hf.first_k_dense_replace
    geometry = ours.kv_geometry()
    assert geometry.bytes_per_token == config.num_layers * config.mla.latent_dim * 4
    # Read back from what we would write: the same config.
    assert type(config).from_hf_dict(config.to_hf_dict()) == config


def test_prefill_logits_equal_transformers(
    checkpoint: Checkpoint, ours: CausalLM, form: MLAForm
) -> None:
    """Cold, on a cached prefix, and token by token after a prefill."""
    prompt = _prompt(seed=1)
    expected = hf_logits(checkpoint.hf, prompt)
    assert expected.std() > 0.3  # the reference says something: the comparison can fail
    pool = new_pool(ours, page_size=PAGE_SIZE)
    slots = SlotAllocator(pool).slots(PROMPT_LEN)
    for steps in ([PROMPT_LEN], [13, PROMPT_LEN - 13], [30] + [1] * (PROMPT_LEN - 30)):
        pool.flat.zero_()
        got = run_in_steps(ours, pool, prompt, slots, steps)
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, s=steps: f"{s}: {m}")


def test_greedy_decode_equals_transformers_kv_cache(checkpoint: Checkpoint, ours: CausalLM) -> None:
    """Two prompts decoded together through the paged pool (the absorbed form), against
    transformers decoding each alone through its own cache."""
    steps = 6
    prompts = [_prompt(seed=2), _prompt(seed=3, length=9)]
    references = [hf_greedy_decode(checkpoint.hf, p, steps) for p in prompts]
    pool = new_pool(ours, num_pages=64, page_size=PAGE_SIZE)
    alloc = SlotAllocator(pool, seed=4)
    slots = [alloc.slots(len(p) + steps) for p in prompts]
    prefill = ForwardBatch.from_sequences(
        prompts, [s[: len(p)] for s, p in zip(slots, prompts, strict=True)]
    )
    first = ours(prefill, pool)
    assert first.argmax(dim=-1).tolist() == [generated[0] for generated, _ in references]
    for step in range(steps - 1):
        tokens = [[generated[step]] for generated, _ in references]
        contexts = [s[: len(p) + step + 1] for s, p in zip(slots, prompts, strict=True)]
        got = ours(ForwardBatch.from_sequences(tokens, contexts), pool)
        for seq, (_, logits) in enumerate(references):
            torch.testing.assert_close(got[seq], logits[step], **TOL)


def test_mixed_batch_equals_transformers(
    checkpoint: Checkpoint, ours: CausalLM, form: MLAForm
) -> None:
    """One step: a cold prefill, a prefill on a cached prefix and two decodes."""
    sequences = [_prompt(10, 12), _prompt(11, 30), _prompt(12, 7), _prompt(13, 25)]
    cached = [0, 17, 6, 24]
    pool = new_pool(ours, num_pages=64, page_size=PAGE_SIZE)
    alloc = SlotAllocator(pool, seed=7)
    slots = [alloc.slots(len(s)) for s in sequences]
    for seq, seq_slots, done in zip(sequences, slots, cached, strict=True):
        if done:
            run_in_steps(ours, pool, seq[:done], seq_slots[:done], [done])
    batch = ForwardBatch.from_sequences(
        [s[c:] for s, c in zip(sequences, cached, strict=True)], slots
    )
    assert batch.extend_lens == (12, 13, 1, 1)
    got = ours(batch, pool)
    expected = torch.stack([hf_logits(checkpoint.hf, s)[-1] for s in sequences])
    torch.testing.assert_close(got, expected, **TOL)


def test_bfloat16_tracks_transformers_bfloat16(checkpoint: Checkpoint) -> None:
    """Loaded in bf16, a prefill stays within rounding of transformers run in bf16. (Not of
    float32: rounding flips some tokens' expert choices, transformers' own bf16 logits
    then differ from its float32 ones by up to ~3 on these checkpoints.)"""
    model = load_model(checkpoint.path, "auto", None, "bfloat16", "cpu").model
    prompt = _prompt(seed=30)
    reference = copy.deepcopy(checkpoint.hf).to(torch.bfloat16)
    expected = hf_logits(reference, prompt)
    pool = new_pool(model, page_size=PAGE_SIZE)
    assert pool.flat.dtype == torch.bfloat16
    slots = SlotAllocator(pool).slots(PROMPT_LEN)
    got = run_in_steps(model, pool, prompt, slots, [PROMPT_LEN])
    error = (got - expected).abs()
    assert torch.isfinite(got).all()
    assert error.max() < 0.25 and error.mean() < 0.02, (float(error.max()), float(error.mean()))
