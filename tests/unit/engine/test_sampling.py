"""Sampling edge cases: nucleus (top-p) sampling always keeps the most likely token."""

from __future__ import annotations

import pytest
import torch

from hicache.engine.api import SamplingParams
from hicache.engine.sampling import make_generator, sample_row


# 1e-300 and 5e-324 round to 0 in float32 (the probabilities' dtype), as does anything
# below about 7e-46; 1e-9 does not and must behave the same.
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-9])
def test_a_tiny_top_p_keeps_the_top_token(top_p: float) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])  # [vocab]
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    assert generator is not None  # a sampled row, not a greedy one
    draws = {sample_row(logits, 1, params, generator) for _ in range(20)}
    assert draws == {1}


def test_top_p_still_samples_from_the_nucleus() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])  # tokens 1 and 3 hold ~90% of the mass
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    draws = {sample_row(logits, 1, params, generator) for _ in range(200)}
    assert draws == {1, 3}
