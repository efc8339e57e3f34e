"""The prompt tokens a step may carry beside decode rows, so that prefill does not starve decodes.

A step that carries decode rows is one inter-token gap of every decoding request: a
full prefill chunk beside them adds the chunk's whole compute to that gap. With a
decode delay set, such a step carries at most as many prompt tokens as the measured
step costs (``StepCosts``) price within that delay. The delay is given in milliseconds
(``--max-decode-delay-ms``), or relative to a decode-only step
(``--max-decode-delay-factor``: it follows the machine's speed, where a fixed delay on
a loaded machine buys only the floor), or both (the smaller applies).

The costs are measured, not fit: a decode-only step's seconds, and a prompt token's
seconds as a prefill step's time beyond a decode-only step, per prompt token (both
moving averages, ``StepCostTracker``). A least-squares fit over prefill steps (the
prefill estimate of ``cost_model.py``) cannot serve here: while every step takes the
same chunk its samples cannot tell a step's fixed cost from its per-token cost.

Invariants:
- a step without decode rows keeps the full ``chunked_prefill_size``: cold prompts
  lose nothing when nothing decodes; the chunk grows back as soon as decodes finish;
- the budget is within [min(``MIN_CHUNK_TOKENS``, chunk), chunk] but for the sample
  steps below: a prompt always progresses, and a decode row waits at most one
  (budgeted) chunk per step;
- with no delay set, the full chunk; with one set, a step that has decode rows and a
  prompt to fill while no decode-only step has been timed (or none for
  ``DECODE_SAMPLE_EVERY`` steps) takes no prompt tokens: the decode-only step it becomes is
  the sample the budget prices with. Without it a server whose prompts keep arriving
  never runs a decode-only step, and the budget, blind, gave every step the full chunk;
- until a prompt token's share is measured (a prefill step alone seeds it with its
  seconds per token, an upper bound), the full chunk;
- the budget only caps prompt tokens: the scheduler plans every decode row first in
  each step, so decode rows are never left out of a step while they wait;
- it is a pure function of the costs it is given: under tensor parallelism every rank
  prices with rank 0's (``replication.Tick.costs`` carries them) and so plans alike.
"""

from __future__ import annotations

from dataclasses import dataclass

# The fewest prompt tokens a step with decode rows carries, however tight the delay:
# below it a step's fixed cost dominates and prompts would crawl.
MIN_CHUNK_TOKENS = 16
# The weight of a new sample in the moving averages: the costs follow the machine's
# load within a few steps, and one outlier moves them by a fifth.
STEP_COST_WEIGHT = 0.2
# A step with decode rows is a decode-only sample at least once every this many steps with
# decode rows: a decode step's cost moves with its rows and their contexts, and while
# prompts keep arriving no step would be decode-only by itself.
DECODE_SAMPLE_EVERY = 64


@dataclass(frozen=True)
class StepCosts:
    """Measured step costs (a snapshot: sent to other ranks); None where not measured yet."""

    decode_step_s: float | None  # a step of decode rows alone
    prompt_token_s: float | None  # what one prompt token adds to a step
    # Steps with decode rows since a decode-only step was last timed.
    steps_since_decode: int = 0

    def wants_decode_sample(self) -> bool:
        """Should the next step with decode rows take no prompt tokens, to be timed?"""
        return self.decode_step_s is None or self.steps_since_decode >= DECODE_SAMPLE_EVERY


class StepCostTracker:
    """Moving averages of a decode-only step's seconds and of a prompt token's (scheduler
    thread only)."""

    def __init__(self, weight: float = STEP_COST_WEIGHT) -> None:
        self.weight = weight
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None
        self.steps_since_decode = 0

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A forward step's wall time, its prompt tokens and decode rows."""
        if prompt_tokens <= 0:
            if decode_rows > 0:
                self.decode_step_s = self._mix(self.decode_step_s, seconds)
                self.steps_since_decode = 0
            return
        if decode_rows > 0:
            self.steps_since_decode += 1
        if self.decode_step_s is None:
            if decode_rows == 0 and self.prompt_token_s is None:
                # A seed until a decode-only step is timed: the whole step per token (its
                # fixed cost included) prices tokens dearer than they are, never cheaper.
                self.prompt_token_s = seconds / prompt_tokens
            return  # its tokens' share is unknown until a decode-only step is timed
        extra = max(seconds - self.decode_step_s, 0.0)
        self.prompt_token_s = self._mix(self.prompt_token_s, extra / prompt_tokens)

    def snapshot(self) -> StepCosts | None:
        if self.decode_step_s is None and self.prompt_token_s is None:
            return None
        return StepCosts(self.decode_step_s, self.prompt_token_s, self.steps_since_decode)


def prefill_budget(
    costs: StepCosts | None,
    chunk: int,
    decode_rows: int,
    delay_s: float | None,
    delay_factor: float | None = None,
    min_tokens: int = MIN_CHUNK_TOKENS,
) -> int:
    """Prompt tokens for a step beside ``decode_rows`` decoding requests: as many as the
    delay buys at ``costs.prompt_token_s`` each, within [min(``min_tokens``, chunk),
    ``chunk``]. The delay is ``delay_s``, or ``delay_factor`` times a decode-only step,
    the smaller of the two when both are given."""
    if decode_rows <= 0 or costs is None or chunk <= 0:
        return chunk
    if costs.decode_step_s is None or costs.prompt_token_s is None:
        return chunk
    if delay_factor is not None:
        relative = delay_factor * costs.decode_step_s
        delay_s = relative if delay_s is None else min(delay_s, relative)
    if delay_s is None or costs.prompt_token_s <= 0:
        return chunk
    tokens = int(delay_s / costs.prompt_token_s)
    return max(min(tokens, chunk), min(min_tokens, chunk))
