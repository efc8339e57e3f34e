"""ForwardBatch: what one model step computes, for any mix of prefills, chunks and decodes.

Each sequence in the batch has a context already in the device pool (a cached
prefix, or the part of its prompt computed by earlier chunks; possibly empty)
and ``extend_len`` new tokens that this step computes and appends. A cold
prefill has no context, a chunk of a long prompt or a prompt with a cache hit
has some, and a decode step is one new token after a long context: the model
does not need to know which is which.

Invariant (what the attention relies on): the new tokens of a sequence are the
last ``extend_len`` tokens of its context, at positions ``seq_len - extend_len
.. seq_len - 1``, and ``context_slots`` lists the whole context (cached prefix +
new tokens) in position order, so the new tokens' slots end it and equal their
``out_slots``. ``check()`` verifies the shapes on the host; ``validate()`` also
the values (it reads device tensors: tests and debugging only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch


class BatchError(ValueError):
    """A ForwardBatch whose fields disagree; the message says which."""


@dataclass(frozen=True)
class ForwardBatch:
    # Token-level, sequences concatenated in batch order (T = sum(extend_lens)).
    input_ids: torch.Tensor  # [T] int64: the new tokens
    positions: torch.Tensor  # [T] int64: absolute position of each new token (for RoPE)
    out_slots: torch.Tensor  # [T] int64: device-pool slots where their K/V are written
    # Sequence-level (host-side ints: building the attention plan must not sync the device).
    extend_lens: tuple[int, ...]  # new tokens per sequence, each >= 1
    seq_lens: tuple[int, ...]  # context length after this step (prefix + new) per sequence
    # [sum(seq_lens)] int64: each sequence's whole context in position order, concatenated.
    context_slots: torch.Tensor
    # Logits for every new token (scoring, tests) instead of only each sequence's last one.
    return_all_logits: bool = False
    # Per sequence, the first of its new tokens whose logits are returned (through its
    # last); None: the last one only. Prompt logprobs need the logits of a run of prompt
    # positions, and only those: projecting a whole chunk onto the vocabulary is the
    # step's largest tensor ([T, vocab]).
    logits_from: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.check()

    # ------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        context_slots: Sequence[torch.Tensor | Sequence[int]],
        device: torch.device | str = "cpu",
        return_all_logits: bool = False,
        logits_from: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """A batch from each sequence's new tokens and its whole context's slots.

        ``context_slots[i]`` covers the cached prefix and then the new tokens, so
        sequence i's prefix length is ``len(context_slots[i]) - len(new_token_ids[i])``.
        """
        if len(new_token_ids) != len(context_slots):
            raise BatchError("one context_slots entry per sequence is needed")
        contexts = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in context_slots]
        extend_lens = tuple(len(ids) for ids in new_token_ids)
        seq_lens = tuple(len(c) for c in contexts)
        positions: list[int] = []
        for extend, total in zip(extend_lens, seq_lens, strict=True):
            positions += range(total - extend, total)
        flat_ids = [int(t) for ids in new_token_ids for t in ids]
        context = torch.cat(contexts) if contexts else torch.empty(0, dtype=torch.int64)
        out_slots = (
            torch.cat([c[len(c) - e :] for c, e in zip(contexts, extend_lens, strict=True)])
            if contexts
            else torch.empty(0, dtype=torch.int64)
        )
        return cls(
            input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_slots=out_slots.to(device),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            context_slots=context.to(device),
            return_all_logits=return_all_logits,
            logits_from=tuple(logits_from) if logits_from is not None else None,
        )

    def to(self, device: torch.device | str) -> ForwardBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            out_slots=self.out_slots.to(device),
            context_slots=self.context_slots.to(device),
        )

    # ------------------------------------------------------------ derived
    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        """Context tokens already in the pool before this step, per sequence."""
        return tuple(s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True))

    @property
    def token_starts(self) -> tuple[int, ...]:
        """Index of each sequence's first new token in the token-level tensors."""
        return (0, *accumulate(self.extend_lens))[:-1]

    @property
    def context_starts(self) -> tuple[int, ...]:
        """Index of each sequence's first context slot in ``context_slots``."""
        return (0, *accumulate(self.seq_lens))[:-1]

    def logit_rows(self) -> list[int]:
        """Token rows whose logits the model returns, in order (see ``logits_from``)."""
        if self.return_all_logits:
            return list(range(self.num_tokens))
        starts = self.token_starts
        if self.logits_from is None:
            return [t0 + extend - 1 for t0, extend in zip(starts, self.extend_lens, strict=True)]
        rows: list[int] = []
        for t0, extend, first in zip(starts, self.extend_lens, self.logits_from, strict=True):
            rows.extend(range(t0 + first, t0 + extend))
        return rows

    # ------------------------------------------------------------ checks
    def check(self) -> None:
        """Shapes and host-side lengths agree (cheap: no device reads)."""
        if len(self.extend_lens) != len(self.seq_lens):
            raise BatchError("extend_lens and seq_lens need one entry per sequence")
        if self.num_seqs == 0:
            raise BatchError("a batch needs at least one sequence")
        for i, (extend, total) in enumerate(zip(self.extend_lens, self.seq_lens, strict=True)):
            if not 1 <= extend <= total:
                raise BatchError(
                    f"sequence {i}: need 1 <= extend_len <= seq_len, got {extend} and {total}"
                )
        if self.logits_from is not None:
            if len(self.logits_from) != self.num_seqs:
                raise BatchError("logits_from needs one entry per sequence")
            for i, (first, extend) in enumerate(
                zip(self.logits_from, self.extend_lens, strict=True)
            ):
                if not 0 <= first < extend:
                    raise BatchError(
                        f"sequence {i}: need 0 <= logits_from < extend_len, got {first} "
                        f"and {extend}"
                    )
        num_tokens = sum(self.extend_lens)
        for name in ("input_ids", "positions", "out_slots"):
            tensor: torch.Tensor = getattr(self, name)
            if tensor.shape != (num_tokens,):
                raise BatchError(
                    f"{name} has shape {tuple(tensor.shape)}, expected ({num_tokens},)"
                )
        if self.context_slots.shape != (sum(self.seq_lens),):
            raise BatchError(
                f"context_slots has shape {tuple(self.context_slots.shape)}, "
                f"expected ({sum(self.seq_lens)},) = sum(seq_lens)"
            )

    def validate(self) -> None:
        """check(), plus the invariant on values: positions and out_slots end each context."""
        self.check()
        positions = self.positions.tolist()
        out_slots = self.out_slots.tolist()
        context = self.context_slots.tolist()
        for i, (t0, c0) in enumerate(zip(self.token_starts, self.context_starts, strict=True)):
            extend, total = self.extend_lens[i], self.seq_lens[i]
            if positions[t0 : t0 + extend] != list(range(total - extend, total)):
                raise BatchError(f"sequence {i}: positions must be {total - extend}..{total - 1}")
            if out_slots[t0 : t0 + extend] != context[c0 + total - extend : c0 + total]:
                raise BatchError(f"sequence {i}: out_slots must be the last slots of its context")
