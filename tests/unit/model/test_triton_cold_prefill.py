"""The Triton backend's cold prefills: attended with causal SDPA over the prompts' own K/V.

A step whose every sequence is a prompt with nothing in the pool before it does not
run the extend kernel (slower than SDPA's flash kernel on long prompts); the result
must be the reference backend's, one prompt or several. A step with a cached prefix
still runs the kernel. No kernel runs here, so no interpreter is needed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from hicache.attention import triton as attention_triton
from hicache.attention.backend import make_attention_backend
from hicache.model.batch import ForwardBatch

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 16, 64


def _step_inputs(batch: ForwardBatch, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    tokens = batch.num_tokens
    q = torch.randn(tokens, HEADS, DIM, generator=generator)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=generator)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=generator)
    k_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=generator)
    k_cache[batch.out_slots], v_cache[batch.out_slots] = k, v  # written before attending
    return q, k, v, k_cache, v_cache


@pytest.mark.parametrize("prompt_lens", [(9,), (5, 12, 1)])
def test_cold_prompts_match_the_reference_without_the_extend_kernel(
    prompt_lens: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the extend kernel ran for a cold prefill")

    monkeypatch.setattr(attention_triton, "extend_attention", refuse)
    starts = [sum(prompt_lens[:i]) for i in range(len(prompt_lens))]
    batch = ForwardBatch.from_sequences(
        [list(range(n)) for n in prompt_lens],
        [list(range(s + 3, s + 3 + n)) for s, n in zip(starts, prompt_lens, strict=True)],
    )
    inputs = _step_inputs(batch, seed=len(prompt_lens))
    got = attention_triton.TritonBackend().prepare(batch).attend(*inputs)
    reference = make_attention_backend("gather", "cpu").prepare(batch).attend(*inputs)
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-5)


def test_a_prefill_over_a_cached_prefix_still_runs_the_extend_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[int] = []

    def counting(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append(1)
        return torch.zeros_like(q)

    monkeypatch.setattr(attention_triton, "extend_attention", counting)
    batch = ForwardBatch.from_sequences([[1, 2, 3], [4, 5]], [list(range(7)), [20, 21]])
    attention_triton.TritonBackend().prepare(batch).attend(*_step_inputs(batch, seed=0))
    assert ran == [1]
