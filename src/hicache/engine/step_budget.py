"""The prompt tokens a step may carry beside decode rows, so that prefill does not starve decodes.

A step that carries decode rows is one inter-token gap of every decoding request: a
full prefill chunk beside them adds the chunk's whole compute to that gap. With a
decode delay set, such a step carries at most as many prompt tokens as the live
prefill fit (``cost_model.py``: seconds per token and per attention pair, fed by every
prefill step) prices within that delay; the rows' own cost and the step's fixed cost
are not part of the delay, as a decode-only step pays them too. The delay is given in
milliseconds (``--max-decode-delay-ms``), or relative to the step of the decode rows
alone as the same fit prices it (``--max-decode-delay-factor``: it follows the
machine's speed, where a fixed delay on a loaded machine buys only the floor), or
both (the smaller applies).

Invariants:
- a step without decode rows keeps the full ``chunked_prefill_size``: cold prompts
  lose nothing when nothing decodes; the chunk grows back as soon as decodes finish;
- the budget is within [min(``MIN_CHUNK_TOKENS``, chunk), chunk]: a prompt always
  progresses, and a decode row waits at most one (budgeted) chunk per step;
- until the fit is known (too few samples), and with no delay set, the full chunk;
- the budget only caps prompt tokens: the scheduler plans every decode row first in
  each step, so decode rows are never left out of a step while they wait;
- it is a pure function of the coefficients it is given: under tensor parallelism
  every rank prices with rank 0's costs (``replication.Tick.costs``) and so plans alike.
"""

from __future__ import annotations

from hicache.estimators import PrefillCoefficients, attention_pairs

# The fewest prompt tokens a step with decode rows carries, however tight the delay:
# below it a step's fixed cost dominates and prompts would crawl.
MIN_CHUNK_TOKENS = 16


def prompt_cost(coef: PrefillCoefficients, tokens: int, context: int) -> float:
    """The seconds ``tokens`` prompt tokens after ``context`` cached ones add to a step."""
    return (coef.seconds_per_token * tokens
            + coef.seconds_per_pair * attention_pairs(tokens, context))


def decode_step_cost(coef: PrefillCoefficients, decode_rows: int) -> float:
    """The seconds of a step of ``decode_rows`` decode rows alone, as the fit prices it."""
    return coef.step_seconds + coef.seconds_per_decode_row * decode_rows


def prefill_budget(
    coef: PrefillCoefficients | None,
    chunk: int,
    decode_rows: int,
    delay_s: float | None,
    context: int = 0,
    min_tokens: int = MIN_CHUNK_TOKENS,
    delay_factor: float | None = None,
) -> int:
    """Prompt tokens for a step beside ``decode_rows`` decoding requests: the most, at
    most ``chunk``, whose cost (``prompt_cost``, the first prefilling request's
    ``context`` before them) fits the delay; never fewer than ``min_tokens``. The delay
    is ``delay_s``, or ``delay_factor`` times ``decode_step_cost``, the smaller of the
    two when both are given."""
    if decode_rows <= 0 or coef is None or chunk <= 0:
        return chunk
    if delay_factor is not None:
        relative = delay_factor * decode_step_cost(coef, decode_rows)
        delay_s = relative if delay_s is None else min(delay_s, relative)
    if delay_s is None:
        return chunk
    if prompt_cost(coef, chunk, context) <= delay_s:
        return chunk
    low = min(min_tokens, chunk)
    if prompt_cost(coef, low, context) > delay_s:
        return low
    high = chunk  # the cost grows with tokens: the largest fitting count, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if prompt_cost(coef, mid, context) <= delay_s:
            low = mid
        else:
            high = mid - 1
    return low
