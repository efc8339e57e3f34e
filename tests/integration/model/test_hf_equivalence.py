"""Our models compute what Hugging Face transformers computes, from the same checkpoint dir.

Every variant (Llama with and without Llama-3.1 RoPE scaling, Qwen2's q/k/v
biases, Qwen3's q/k norm; tied and untied embeddings; MHA, GQA, MQA) is written
by transformers' ``save_pretrained`` and read back by ``load_model``. In float32
on CPU the logits of a prefill, of decode steps through the paged KV pool, of a
prefill on a cached prefix and of a mixed batch equal transformers' to 1e-4.
Loaded in bfloat16 or float16 the model runs and stays within rounding of that;
with CUDA the GPU attention paths are checked the same way in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

from hicache.model.batch import ForwardBatch
from hicache.model.config import Architecture
from hicache.model.loader import load_model
from hicache.model.model import CausalLM
from tests.hf_checkpoints import (
    VOCAB,
    Checkpoint,
    hf_greedy_decode,
    hf_logits,
    variants,
    write_checkpoint,
)
from tests.model_scenarios import SlotAllocator, new_pool, random_tokens, run_in_steps

VARIANTS = variants()
TOL = {"atol": 1e-4, "rtol": 1e-5}
PROMPT_LEN = 41  # past the llama3 variant's original context (32)
PAGE_SIZE = 4


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    path = tmp_path_factory.mktemp(request.param)
    return write_checkpoint(VARIANTS[request.param], path)


@pytest.fixture(scope="module")
def ours(checkpoint: Checkpoint) -> CausalLM:
    return load_model(checkpoint.path, "auto", None, "float32", "cpu").model


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return random_tokens(length, VOCAB, seed)


def test_config_is_read_as_written(checkpoint: Checkpoint, ours: CausalLM) -> None:
    hf: PretrainedConfig = checkpoint.hf.config
    config = ours.config
    assert config.architecture is Architecture(hf.architectures[0])
    assert (config.num_heads, config.num_kv_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert (config.rope_scaling is not None) == (hf.rope_parameters["rope_type"] == "llama3")
    assert config.qk_norm == (config.architecture is Architecture.QWEN3)


def test_prefill_logits_equal_transformers(checkpoint: Checkpoint, ours: CausalLM) -> None:
    prompt = _prompt(seed=1)
    pool = new_pool(ours, page_size=PAGE_SIZE)
    slots = SlotAllocator(pool).slots(PROMPT_LEN)
    got = run_in_steps(ours, pool, prompt, slots, [PROMPT_LEN])
    expected = hf_logits(checkpoint.hf, prompt)
    assert expected.std() > 0.3  # the reference says something: the comparison can fail
    torch.testing.assert_close(got, expected, **TOL)


def test_greedy_decode_equals_transformers_kv_cache(checkpoint: Checkpoint, ours: CausalLM) -> None:
    """Two prompts decoded together, one token per step each, through the paged pool;
    transformers decodes each alone through its own KV cache."""
    steps = 6
    prompts = [_prompt(seed=2, length=PROMPT_LEN), _prompt(seed=3, length=9)]
    references = [hf_greedy_decode(checkpoint.hf, p, steps) for p in prompts]
    pool = new_pool(ours, num_pages=64, page_size=PAGE_SIZE)
    alloc = SlotAllocator(pool, seed=4)
    slots = [alloc.slots(len(p) + steps) for p in prompts]

    # Prefill both in one step; their first generated tokens are transformers'.
    prefill = ForwardBatch.from_sequences(
        prompts, [s[: len(p)] for s, p in zip(slots, prompts, strict=True)]
    )
    first = ours(prefill, pool)
    assert first.argmax(dim=-1).tolist() == [generated[0] for generated, _ in references]

    for step in range(steps - 1):
        tokens = [[generated[step]] for generated, _ in references]
        contexts = [s[: len(p) + step + 1] for s, p in zip(slots, prompts, strict=True)]
        batch = ForwardBatch.from_sequences(tokens, contexts)
        batch.validate()
        got = ours(batch, pool)
        for seq, (_, logits) in enumerate(references):
            torch.testing.assert_close(got[seq], logits[step], **TOL)


@pytest.mark.parametrize("prefix_len", [16, 13], ids=["page-aligned", "unaligned"])
def test_prefill_on_a_cached_prefix_equals_one_shot(
    checkpoint: Checkpoint, ours: CausalLM, prefix_len: int
) -> None:
    prompt = _prompt(seed=5)
    pool = new_pool(ours, page_size=PAGE_SIZE)
    slots = SlotAllocator(pool, seed=6).slots(PROMPT_LEN)
    one_shot = run_in_steps(ours, pool, prompt, slots, [PROMPT_LEN])
    pool.flat.zero_()  # nothing of the one-shot run may help the two-step one
    two_steps = run_in_steps(ours, pool, prompt, slots, [prefix_len, PROMPT_LEN - prefix_len])
    torch.testing.assert_close(two_steps, one_shot, **TOL)
    torch.testing.assert_close(two_steps, hf_logits(checkpoint.hf, prompt), **TOL)


def test_mixed_batch_equals_transformers(checkpoint: Checkpoint, ours: CausalLM) -> None:
    """One step holding a cold prefill, a prefill on a cached prefix and two decodes:
    each sequence's last logits are transformers' for its whole token sequence."""
    sequences = [_prompt(10, 12), _prompt(11, 30), _prompt(12, 7), _prompt(13, 25)]
    cached = [0, 17, 6, 24]  # tokens of each sequence already in the pool
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


# ---------------------------------------------------------------------- half precision
@pytest.mark.parametrize(
    ("dtype", "max_err", "mean_err"),
    [(torch.bfloat16, 0.15, 0.02), (torch.float16, 0.02, 0.003)],
    ids=["bf16", "fp16"],
)
def test_half_precision_runs_close_to_float32(
    checkpoint: Checkpoint, dtype: torch.dtype, max_err: float, mean_err: float
) -> None:
    """Loaded in bf16 / fp16 (weights, RoPE tables and the KV pool in that dtype), every
    way of stepping through the prompt stays finite and within rounding of float32.
    Measured errors are about half the bounds (bf16 keeps 8 mantissa bits, fp16 11)."""
    loaded = load_model(checkpoint.path, "auto", None, dtype, "cpu")
    model = loaded.model
    assert loaded.config.dtype == dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    prompt = _prompt(seed=30)
    expected = hf_logits(checkpoint.hf, prompt)
    pool = new_pool(model, page_size=PAGE_SIZE)
    assert pool.flat.dtype == dtype
    slots = SlotAllocator(pool).slots(PROMPT_LEN)
    for steps in ([PROMPT_LEN], [13, PROMPT_LEN - 13], [30] + [1] * (PROMPT_LEN - 30)):
        got = run_in_steps(model, pool, prompt, slots, steps)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        error = (got - expected).abs()
        assert error.max() < max_err, f"{steps}: max error {error.max():.4f}"
        assert error.mean() < mean_err, f"{steps}: mean error {error.mean():.5f}"


# ---------------------------------------------------------------------- CUDA, bfloat16
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_tracks_transformers(checkpoint: Checkpoint) -> None:
    """The CUDA-only attention paths (flash causal, lower-right causal bias over a cached
    prefix, padded decode, and all of them in one mixed step) in bf16 stay within the
    CPU bf16 bounds of transformers' float32 logits."""
    ours = load_model(checkpoint.path, "auto", None, "bfloat16", "cuda").model
    prompt = _prompt(seed=20)
    expected = hf_logits(checkpoint.hf, prompt)
    pool = new_pool(ours, num_pages=64, page_size=PAGE_SIZE)
    alloc = SlotAllocator(pool)
    slots = alloc.slots(PROMPT_LEN)
    for steps in ([PROMPT_LEN], [13, PROMPT_LEN - 13], [20] + [1] * (PROMPT_LEN - 20)):
        got = run_in_steps(ours, pool, prompt, slots, steps).cpu()
        assert torch.isfinite(got).all()
        error = (got - expected).abs()
        assert error.max() < 0.15 and error.mean() < 0.02, f"{steps}: {error.max():.4f}"

    # One step: a cold prompt, the rest of a prompt on a cached prefix, two decodes.
    sequences = [_prompt(21, 12), _prompt(22, 30), _prompt(23, 7), _prompt(24, 25)]
    cached = [0, 17, 6, 24]
    contexts = [alloc.slots(len(s)) for s in sequences]
    for seq, context, done in zip(sequences, contexts, cached, strict=True):
        if done:
            run_in_steps(ours, pool, seq[:done], context[:done], [done])
    batch = ForwardBatch.from_sequences(
        [s[c:] for s, c in zip(sequences, cached, strict=True)], contexts, device="cuda"
    )
    got = ours(batch, pool).cpu()
    expected = torch.stack([hf_logits(checkpoint.hf, s)[-1] for s in sequences])
    error = (got - expected).abs()
    assert error.max() < 0.15 and error.mean() < 0.02, f"mixed: {error.max():.4f}"
