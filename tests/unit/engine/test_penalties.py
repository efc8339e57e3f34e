"""Penalties and min_new_tokens masks on rows of logits: by hand, and the repetition
penalty against transformers' own RepetitionPenaltyLogitsProcessor."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hicache.engine.api import SamplingParams
from hicache.engine.penalties import PenaltyState, RowAdjustment, adjust_logits, ending_tokens

CPU = torch.device("cpu")


def state(prompt: list[int], output: list[int], vocab: int) -> PenaltyState:
    penalties = PenaltyState(prompt, vocab, CPU)
    for token in output:
        penalties.add(token)
    return penalties


def test_repetition_penalty_matches_transformers() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(2, vocab, generator=generator) * 3  # [batch, vocab]
    sequences = [[1, 4, 4, 9, 30], [2, 3, 49, 0]]  # prompt + output so far
    penalty = 1.7
    rows = [RowAdjustment(SamplingParams(repetition_penalty=penalty),
                          state(seq[:2], seq[2:], vocab)) for seq in sequences]
    ours = adjust_logits(logits, rows)
    processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for row, seq in enumerate(sequences):
        theirs = processor(torch.tensor([seq]), logits[row : row + 1].clone())[0]
        torch.testing.assert_close(ours[row], theirs)


def test_frequency_and_presence_by_hand_beside_untouched_rows() -> None:
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5], [1.0, -2.0, 3.0, 0.5]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                            repetition_penalty=2.0)
    # Prompt [3], output [2, 2, 1]: 3 seen in the prompt only (repetition only).
    rows = [RowAdjustment(params, state([3], [2, 2, 1], 4)), RowAdjustment(SamplingParams(), None)]
    out = adjust_logits(logits, rows)
    expected = torch.tensor([
        1.0,  # never seen
        -2.0 * 2.0 - 0.5 * 1 - 0.25,  # negative: multiplied, then once in the output
        3.0 / 2.0 - 0.5 * 2 - 0.25,  # positive: divided, then twice in the output
        0.5 / 2.0,  # prompt only: no frequency or presence penalty
    ])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])
    torch.testing.assert_close(logits[0], torch.tensor([1.0, -2.0, 3.0, 0.5]))  # not in place


def test_min_new_tokens_masks_eos_and_stop_tokens() -> None:
    params = SamplingParams(stop_token_ids=(1,), min_new_tokens=2)
    assert ending_tokens(params, {3}) == (1, 3)
    assert ending_tokens(SamplingParams(stop_token_ids=(1,), ignore_eos=True), {3}) == (1,)
    logits = torch.zeros(2, 4)
    out = adjust_logits(logits, [RowAdjustment(params, None, (1, 3)),
                                 RowAdjustment(params, None, ())])
    assert out[0].tolist() == [0.0, float("-inf"), 0.0, float("-inf")]
    assert out[1].tolist() == [0.0] * 4
