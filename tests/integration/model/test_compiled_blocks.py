"""The compiled layer blocks compute what the eager ones do, for any number of tokens."""

from __future__ import annotations

import torch

from tests.model_scenarios import (
    SlotAllocator,
    dummy_model,
    new_pool,
    random_tokens,
    run_in_steps,
    small_qwen3_style,
)


def test_compiled_model_equals_eager_across_prefill_and_decode() -> None:
    # Qwen3-style (qk-norm, biases) and token counts 1 (decode) and 20 (prefill), 7:
    # one compile, dynamic in the token count, serves every step.
    config = small_qwen3_style()
    eager = dummy_model(config)
    compiled = dummy_model(config)
    compiled.compile_blocks()
    assert compiled.blocks.pre is not eager.blocks.pre
    tokens = random_tokens(29, config.vocab_size, seed=3)
    steps = [20, 7, 1, 1]
    results = []
    for model in (eager, compiled):
        pool = new_pool(model)
        slots = SlotAllocator(pool).slots(len(tokens))
        with torch.inference_mode():
            results.append(run_in_steps(model, pool, tokens, slots, steps))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(results[1].argmax(-1), results[0].argmax(-1))
