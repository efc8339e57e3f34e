"""Shared KV-cache scenarios for the model tests (CPU fp32 in tests/unit, CUDA bf16 in tests/gpu).

A prompt is computed in steps: ``steps`` lists how many new tokens each step
adds, so ``[n]`` is one cold prefill, ``[k, n - k]`` a cached prefix of k tokens
then the rest, ``[3, 5, ...]`` chunked prefill, ``[1] * n`` token-by-token
decode. Each step reads the K/V earlier steps left in the pool. Contexts live
on shuffled pages, as after cache churn.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.config import ModelConfig
from hicache.model.model import CausalLM
from hicache.model.presets import get_preset
from hicache.model.weights import init_dummy_weights


def small_qwen3_style(num_layers: int = 2) -> ModelConfig:
    """Qwen3 with everything that changes the weight mapping, at test size.

    q/k norm, biases on all four attention projections, tied embeddings,
    head_dim != hidden / heads, 3 query heads per KV head; float32.
    """
    return dataclasses.replace(
        get_preset("qwen3-0.6b"),
        vocab_size=300,
        hidden_size=48,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        qkv_bias=True,
        o_bias=True,
        dtype=torch.float32,
    )


def dummy_model(config: ModelConfig, device: str = "cpu", seed: int = 0) -> CausalLM:
    model = CausalLM(config, device=device)
    init_dummy_weights(model, seed=seed, std=0.05)
    return model


def new_pool(model: CausalLM, num_pages: int = 64, page_size: int = 4) -> DevicePool:
    return DevicePool(model.config.kv_geometry(model.dtype), num_pages, page_size, model.device)


class SlotAllocator:
    """Hands out the slots of randomly chosen free pages of a pool."""

    def __init__(self, pool: DevicePool, seed: int = 0) -> None:
        self.pool = pool
        self.free = list(range(pool.num_pages))
        random.Random(seed).shuffle(self.free)

    def slots(self, num_tokens: int) -> torch.Tensor:
        num_pages = -(-num_tokens // self.pool.page_size)
        pages, self.free = self.free[:num_pages], self.free[num_pages:]
        assert len(pages) == num_pages, "test pool too small"
        return self.pool.slots(torch.tensor(pages))[:num_tokens].to(self.pool.device)


def run_in_steps(
    model: CausalLM, pool: DevicePool, tokens: list[int], slots: torch.Tensor, steps: list[int]
) -> torch.Tensor:
    """All-token logits [len(tokens), vocab] of ``tokens`` computed ``steps`` tokens at a time."""
    assert sum(steps) == len(tokens)
    outputs = []
    done = 0
    for n in steps:
        batch = ForwardBatch.from_sequences(
            [tokens[done : done + n]],
            [slots[: done + n]],
            device=model.device,
            return_all_logits=True,
        )
        outputs.append(model(batch, pool))
        done += n
    return torch.cat(outputs)


def random_tokens(count: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(count)]


def mixed_batch_vs_alone(
    model: CausalLM, prompt_lens: tuple[int, int], decode_contexts: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a mixed step, and of the same sequences each stepped alone.

    The step holds a cold prefill, a prefill on a cached prefix, and one decode
    per entry of ``decode_contexts`` (their context lengths). Contexts are
    computed first; both ways start from that same pool state.
    Returns (batched, alone), each [num_seqs, vocab] (last token of each sequence).
    """
    vocab = model.config.vocab_size
    pool = new_pool(model, num_pages=256)
    alloc = SlotAllocator(pool, seed)
    cold_len, cached_len = prompt_lens
    new_tokens: list[list[int]] = []
    contexts: list[torch.Tensor] = []
    # Cold prefill: nothing in the pool.
    new_tokens.append(random_tokens(cold_len, vocab, seed + 1))
    contexts.append(alloc.slots(cold_len))
    # Cached prefix of 9 tokens (not page-aligned), then cached_len new ones.
    prefix = random_tokens(9 + cached_len, vocab, seed + 2)
    slots = alloc.slots(len(prefix))
    run_in_steps(model, pool, prefix[:9], slots[:9], [9])
    new_tokens.append(prefix[9:])
    contexts.append(slots)
    # Decodes: their whole context but the last token is in the pool.
    for i, length in enumerate(decode_contexts):
        tokens = random_tokens(length, vocab, seed + 10 + i)
        slots = alloc.slots(length)
        run_in_steps(model, pool, tokens[:-1], slots[:-1], [length - 1])
        new_tokens.append(tokens[-1:])
        contexts.append(slots)

    before = pool.flat.clone()
    batch = ForwardBatch.from_sequences(new_tokens, contexts, device=model.device)
    batch.validate()
    batched = model(batch, pool)
    alone = []
    for ids, ctx in zip(new_tokens, contexts, strict=True):
        pool.flat.copy_(before)
        alone.append(model(ForwardBatch.from_sequences([ids], [ctx], device=model.device), pool))
    return batched, torch.cat(alone)
