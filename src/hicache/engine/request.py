"""A request's life inside the scheduler: its tokens, its pages, its cache hold.

Owned by the scheduler thread only. ``pages`` lists the device pages of the
whole context in order; pages ``[:owned_from]`` belong to the radix tree (a
cached prefix the request holds locked through ``hit``) and the rest to the
request until it hands them to the tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.cache.hierarchical_cache import PrefixHit
from hicache.cache.l3 import PrefetchHandle
from hicache.engine.api import CachedTokens, GenerateRequest, HintOutcome, TokenLogprob
from hicache.engine.grammar import GrammarState
from hicache.engine.logprobs import first_prompt_token
from hicache.engine.output_thread import Stream
from hicache.engine.penalties import PenaltyState
from hicache.engine.sampling import is_greedy
from hicache.memory.allocator import PageIds
from hicache.radix.keys import TOKEN_BYTES, PackedTokens, pack_tokens
from hicache.radix.results import no_pages
from hicache.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from hicache.engine.reuse import ReuseTrack


class Phase(str, Enum):
    WAITING = "waiting"  # queued, maybe prefetching from L3
    PREFILL = "prefill"  # prompt being computed, chunk by chunk
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    request: GenerateRequest
    rid: str
    stream: Stream  # where its outputs go (the output thread's side)
    # Run by the scheduler for a request with stop strings, else by the output thread.
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    arrived: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Context in the device pool: tokens[:num_computed] have their KV at slots of ``pages``.
    pages: PageIds = field(default_factory=no_pages)
    owned_from: int = 0
    num_computed: int = 0
    hit: PrefixHit | None = None
    prefetch: PrefetchHandle | None = None
    prefetch_tried: bool = False
    storage_tokens: int = 0  # tokens the L3 prefetch contributed
    storage_from_page: int = 0  # where they begin in its prompt
    # Pages of its prefix it was seen to have while it waited: what the local tiers held
    # when its prefetch started, then what the prefetch found in L3; Prefetcher.settled.
    prefix_pages_seen: int = 0
    refetched: bool = False  # its prefix left the host while it waited, and was fetched again
    # Its load-or-recompute choice, where a tier beyond the device held part of its prompt.
    reuse_track: ReuseTrack | None = None
    cached: CachedTokens = field(default_factory=CachedTokens)
    first_token_at: float | None = None
    # Its text so far, when the scheduler detokenizes it (stop strings: scheduler_text),
    # and how much of it was searched for them.
    text: str = ""
    scanned_chars: int = 0
    finish_reason: str | None = None
    finished_at: float = 0.0
    # The outcomes of its own hints (GenerateRequest.hints), applied at its finish.
    hint_outcomes: list[HintOutcome] | None = None
    error: str | None = None
    num_retractions: int = 0
    row: int | None = None  # its row of the model runner's page table while it runs
    # Since when it has been short of device pages while running alone (see the scheduler).
    short_since: float | None = None
    # Log probabilities (GenerateRequest.logprobs): the prompt's computed so far, the next
    # prompt position still wanted (prompt_len: none), and the output's, one per token.
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_next: int = -1  # set in __post_init__
    input_logprobs_sent: bool = False
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    penalties: PenaltyState | None = None  # made on the scheduler thread when first needed
    # Its grammar's matcher (SamplingParams.grammar), compiled where it was submitted;
    # advanced by each output token, so a retraction (which keeps the output) keeps it right.
    grammar: GrammarState | None = None
    # Set by the scheduler at its first admission (they depend on the engine): the tokens
    # that end it once min_new_tokens are out, and the context length at which it stops.
    stop_ids: frozenset[int] = frozenset()
    length_limit: int = 0
    # Prefill instance (disaggregation): its KV was handed to a decode instance (or that
    # failed); it finishes now like any request.
    kv_handed_off: bool = False

    def __post_init__(self) -> None:
        self._prompt_len = len(self.request.input_ids)  # read several times per step
        self._packed_prompt: bytes | None = None  # the prompt packed, on first lookup
        sampling = self.request.sampling
        # Whether it stops depends on its text: the scheduler detokenizes it.
        self.scheduler_text = bool(sampling.stop)
        # Its next token is always the argmax of the model's logits: nothing to adjust
        # (penalties, min_new_tokens' mask), draw or report (logprobs).
        self.plain_greedy = (
            is_greedy(sampling) and not sampling.has_penalties and sampling.min_new_tokens == 0
            and self.request.logprobs is None and sampling.grammar is None
        )
        params = self.request.logprobs
        self.logprob_next = self.prompt_len
        if params is not None and params.wants_input(self.prompt_len):
            self.logprob_next = params.input_from
            if self.logprob_next == 0:
                self.input_logprobs.append(first_prompt_token(self.request.input_ids[0]))
                self.logprob_next = 1

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    def tokens(self) -> list[int]:
        """Prompt then output: the sequence whose KV the context holds."""
        return [*self.request.input_ids, *self.output_ids]

    def token_at(self, position: int) -> int:
        """The context's token at ``position`` (prompt, then output)."""
        past = position - self._prompt_len
        return self.request.input_ids[position] if past < 0 else self.output_ids[past]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens()[start:end]`` without building the whole list."""
        prompt = self.request.input_ids
        n = len(prompt)
        if end <= n:
            return list(prompt[start:end])
        if start >= n:
            return self.output_ids[start - n : end - n]
        return [*prompt[start:], *self.output_ids[: end - n]]

    def match_tokens(self) -> list[int]:
        """The tokens whose cached KV it may reuse: all but the last, which is always
        computed (its logits give the next token).

        A request that wants the prompt's logprobs from position p needs the logits of
        positions p - 1 on, and a cached prefix is not recomputed (no logits): it
        reuses at most p - 1 tokens, so its logprobs are those of a cold run.
        """
        return self.tokens()[: self._match_limit()]

    def match_key(self) -> PackedTokens:
        """``match_tokens()`` packed for the cache's lookups (``radix.keys.PackedTokens``):
        the prompt is packed once, its outputs (few while it waits) at each call."""
        limit = self._match_limit()
        prompt = self._packed_prompt
        if prompt is None:
            prompt = self._packed_prompt = pack_tokens(self.request.input_ids)
        past = limit - self._prompt_len
        if past <= 0:
            return PackedTokens(prompt[: limit * TOKEN_BYTES])
        return PackedTokens(prompt + pack_tokens(self.output_ids[:past]))

    def _match_limit(self) -> int:
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, self.logprob_next - 1)
        return limit

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether prompt logprobs are still to be computed."""
        return self.logprob_next < self.prompt_len

    @property
    def seq_len(self) -> int:
        return self._prompt_len + len(self.output_ids)

    @property
    def owned_pages(self) -> PageIds:
        return self.pages[self.owned_from :]

    def add_pages(self, new: PageIds) -> None:
        self.pages = np.concatenate([self.pages, new]) if len(self.pages) else new
