"""ForwardBatch: what one model step computes, for any mix of prefills, chunks and decodes.

Each sequence in the batch has a context already in the device pool (a cached
prefix, or the part of its prompt computed by earlier chunks; possibly empty)
and ``extend_len`` new tokens that this step computes and appends. A cold
prefill has no context, a chunk of a long prompt or a prompt with a cache hit
has some, and a decode step is one new token after a long context: the model
does not need to know which is which.

Where a context lies is told by a page table: row ``table_rows[i]`` of
``page_table`` lists sequence i's pages in position order, so its token at
position p has its K/V at slot ``page_table[row, p // page_size] * page_size +
p % page_size``. The engine keeps one such table for all running requests and
updates it only where pages are added or replaced (``hicache.engine.page_table``):
building a step costs the host O(batch), whatever the contexts' lengths, and
attention backends read K/V in place through it.

Invariant (what the attention relies on): the new tokens of a sequence are the
last ``extend_len`` tokens of its context, at positions ``seq_len - extend_len
.. seq_len - 1``, and their slots (through the table) are their ``out_slots``.
``check()`` verifies the shapes on the host; ``validate()`` also the values (it
reads device tensors: tests and debugging only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
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
    # [rows, max_pages] int32: pages of contexts in position order (entries past a
    # context's last page are never read); sequence i is row table_rows[i].
    page_table: torch.Tensor
    table_rows: torch.Tensor  # [B] int32
    page_size: int
    # Logits for every new token (scoring, tests) instead of only each sequence's last one.
    return_all_logits: bool = False
    # Per sequence, the first of its new tokens whose logits are returned (through its
    # last); None: the last one only. Prompt logprobs need the logits of a run of prompt
    # positions, and only those: projecting a whole chunk onto the vocabulary is the
    # step's largest tensor ([T, vocab]).
    logits_from: tuple[int, ...] | None = None
    # Captured steps (``hicache.engine.decode_graphs``): the sequences' true lengths,
    # int32 [B] on the device, filled in before every replay. ``seq_lens`` then holds
    # host-side upper bounds, which size the work (table width, key splits) and
    # nothing else; only attention backends with ``reads_device_lengths`` take such
    # a batch.
    device_seq_lens: torch.Tensor | None = None

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
        The slots become a page table of one-token pages (tests and tools; the engine
        builds its batches from its persistent table).
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
        out_slots = (
            torch.cat([c[len(c) - e :] for c, e in zip(contexts, extend_lens, strict=True)])
            if contexts
            else torch.empty(0, dtype=torch.int64)
        )
        table = torch.zeros((len(contexts), max(seq_lens, default=0)), dtype=torch.int32)
        for row, context in enumerate(contexts):
            table[row, : len(context)] = context
        return cls(
            input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_slots=out_slots.to(device),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            page_table=table.to(device),
            table_rows=torch.arange(len(contexts), dtype=torch.int32, device=device),
            page_size=1,
            return_all_logits=return_all_logits,
            logits_from=tuple(logits_from) if logits_from is not None else None,
        )

    def to(self, device: torch.device | str) -> ForwardBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            out_slots=self.out_slots.to(device),
            page_table=self.page_table.to(device),
            table_rows=self.table_rows.to(device),
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

    @cached_property
    def seq_lens_tensor(self) -> torch.Tensor:
        """``seq_lens`` as int32 [B] on the batch's device (``device_seq_lens`` if set)."""
        if self.device_seq_lens is not None:
            return self.device_seq_lens
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.page_table.device)

    @cached_property
    def sequence_pages(self) -> torch.Tensor:
        """[B, pages of the longest context] int32: each sequence's own table row, cut to
        the pages any of them uses (a gather of B short rows, not of any context)."""
        width = -(-max(self.seq_lens) // self.page_size)
        return self.page_table[self.table_rows.long(), :width]

    @cached_property
    def context_slots(self) -> torch.Tensor:
        """[sum(seq_lens)] int64: every context's slots in position order, concatenated.

        O(total context) on the device: for the reference attention and for checks.
        """
        longest = max(self.seq_lens)
        device = self.page_table.device
        pos = torch.arange(longest, device=device)
        pages = self.sequence_pages.long()[:, pos // self.page_size]  # [B, longest]
        slots = pages * self.page_size + pos % self.page_size
        lens = torch.tensor(self.seq_lens, device=device)
        return slots[pos[None, :] < lens[:, None]]

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
        if self.table_rows.shape != (self.num_seqs,):
            raise BatchError(
                f"table_rows has shape {tuple(self.table_rows.shape)}, "
                f"expected ({self.num_seqs},): one row per sequence"
            )
        if self.page_table.dim() != 2 or self.page_table.dtype != torch.int32:
            raise BatchError("page_table must be a 2-D int32 tensor [rows, max_pages]")
        if self.page_size < 1:
            raise BatchError(f"page_size must be >= 1, got {self.page_size}")
        reach = self.page_table.shape[1] * self.page_size
        if max(self.seq_lens) > reach:
            raise BatchError(
                f"a context of {max(self.seq_lens)} tokens does not fit the page table's "
                f"{self.page_table.shape[1]} pages of {self.page_size} tokens"
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
