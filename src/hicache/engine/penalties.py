"""Logit adjustments a request asks for before its next token is chosen.

``min_new_tokens`` masks the tokens that would end the request (eos unless
``ignore_eos``, and its stop tokens) until that many tokens are out.
``repetition_penalty`` (SGLang/Hugging Face semantics) divides the positive
logits of every token seen in the prompt or the output so far and multiplies
the negative ones; ``frequency_penalty`` and ``presence_penalty`` (OpenAI
semantics) subtract, from each token's logit, the penalty times its count in
the output / once if it occurs there at all. A request with a grammar then has
every token its grammar forbids next masked (hicache.engine.grammar), last, so
that nothing it forbids can come back.

Each request keeps its counts in a ``PenaltyState`` on the logits' device,
updated one token at a time; the adjustment of a batch's rows is a handful of
vectorised operations over their stacked states. All of it is deterministic,
so greedy requests with penalties stay deterministic.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from hicache.engine.api import SamplingParams
from hicache.engine.grammar import GrammarState, mask_logits


class PenaltyState:
    """One request's token counts, as its penalties need them."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        # Tokens of the prompt or the output: what the repetition penalty applies to.
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt_ids:
            self.seen[torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True

    def add(self, token: int) -> None:
        self.output_counts[token] += 1
        self.seen[token] = True


@dataclass(frozen=True)
class RowAdjustment:
    """What one row of logits gets: its penalties (with their state) and banned tokens."""

    params: SamplingParams
    state: PenaltyState | None  # None: no penalties
    banned: tuple[int, ...] = ()  # token ids masked out (min_new_tokens)
    grammar: GrammarState | None = None  # its grammar's matcher: what it may draw next

    @property
    def is_noop(self) -> bool:
        return self.state is None and not self.banned and self.grammar is None


def ending_tokens(params: SamplingParams, eos_token_ids: Collection[int]) -> tuple[int, ...]:
    """The tokens that would end a request: masked while it is under min_new_tokens."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return tuple(sorted(ids))


def adjust_logits(logits: torch.Tensor, rows: Sequence[RowAdjustment]) -> torch.Tensor:
    """``logits`` [num_rows, vocab] float32 with each row's adjustment applied (a new
    tensor; ``logits`` itself is left as the model gave it, for logprobs)."""
    out = logits.clone()
    penalised = [i for i, row in enumerate(rows) if row.state is not None]
    if penalised:
        device = logits.device
        index = torch.tensor(penalised, dtype=torch.int64, device=device)
        states = [rows[i].state for i in penalised]
        seen = torch.stack([s.seen for s in states if s is not None])  # [k, vocab]
        counts = torch.stack([s.output_counts for s in states if s is not None])  # [k, vocab]
        params = [rows[i].params for i in penalised]
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        chosen = out[index]  # [k, vocab]
        repeated = torch.where(chosen > 0, chosen / repetition, chosen * repetition)
        chosen = torch.where(seen, repeated, chosen)
        chosen = chosen - frequency * counts - presence * (counts > 0).float()
        out[index] = chosen
    banned_rows = [i for i, row in enumerate(rows) for _ in row.banned]
    if banned_rows:
        banned_ids = [t for row in rows for t in row.banned]
        device = logits.device
        out[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = (
            float("-inf")
        )
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if constrained:
        mask_logits(out, constrained, [g for i in constrained if (g := rows[i].grammar)])
    return out
