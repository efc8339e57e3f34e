"""Log probabilities of positions, as requests ask for them (``LogprobParams``).

The distribution is the model's own: ``log_softmax`` of the raw logits, before
penalties, temperature and top-k/top-p. A row of logits at position j gives
the logprob of the token at position j + 1: the prompt's logprobs from
position p need the logits of positions p - 1 on (the scheduler makes sure
those are computed rather than taken from the cache), and the first prompt
token has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache.engine.api import LogprobParams, TokenLogprob


def position_logprobs(
    logits: torch.Tensor, next_ids: Sequence[int], params: LogprobParams
) -> list[TokenLogprob]:
    """One entry per row of ``logits`` [num_rows, vocab]: the logprob of ``next_ids[r]``
    under row r, its top ``params.top_n`` and the asked ``params.token_ids``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    ids = torch.tensor(list(next_ids), dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if params.top_n > 0:
        values, indices = torch.topk(logprobs, min(params.top_n, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)]
    asked: list[tuple[float, ...]] = [()] * len(chosen)
    if params.token_ids:
        wanted = torch.tensor(list(params.token_ids), dtype=torch.int64, device=logits.device)
        asked = [tuple(row) for row in logprobs[:, wanted].tolist()]
    return [
        TokenLogprob(token_id=int(t), logprob=float(lp), top=top, asked=a)
        for t, lp, top, a in zip(next_ids, chosen, tops, asked, strict=True)
    ]


def first_prompt_token(token_id: int) -> TokenLogprob:
    """The prompt's first token: nothing predicts it (SGLang's ``None``)."""
    return TokenLogprob(token_id=token_id, logprob=None)


# --------------------------------------------------------------- disaggregation
# A prefill instance computes the prompt and the first token, so the logprobs of both
# are its own; it hands them to the decode instance with the first token, as JSON:
# {"input": [entry, ...], "first": entry}, each entry [token id, logprob or null,
# [[id, logprob], ...] (top), [logprob, ...] (asked)].


def handoff_logprobs(
    input_logprobs: Sequence[TokenLogprob], first: TokenLogprob
) -> dict[str, Any]:
    """The JSON a prefill instance sends with the first token (see above)."""
    return {"input": [_entry(e) for e in input_logprobs], "first": _entry(first)}


def received_logprobs(
    data: Any, params: LogprobParams
) -> tuple[list[TokenLogprob], TokenLogprob]:
    """The prompt's and the first token's logprobs from a prefill instance's JSON;
    ValueError when it is malformed or does not answer ``params`` (another top-n,
    other asked tokens): the decode instance then fails the request rather than
    answer with logprobs it was not asked for."""
    try:
        entries = [_token_logprob(e) for e in data["input"]]
        first = _token_logprob(data["first"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"malformed logprobs from the prefill instance: {error!r}") from error
    if first.logprob is None:
        raise ValueError("the prefill instance sent no logprob for the first token")
    for entry in (*entries, first):
        predicted = entry.logprob is not None  # all but the prompt's first token
        top_n = params.top_n if predicted else 0
        asked = len(params.token_ids) if predicted else 0
        if len(entry.top) != top_n or len(entry.asked) != asked:
            raise ValueError("the prefill instance's logprobs do not answer this request's "
                             "top_logprobs_num / token_ids_logprob")
    return entries, first


def _entry(e: TokenLogprob) -> list[Any]:
    return [e.token_id, e.logprob, [list(pair) for pair in e.top], list(e.asked)]


def _token_logprob(entry: Any) -> TokenLogprob:
    token_id, logprob, top, asked = entry
    return TokenLogprob(
        token_id=int(token_id), logprob=None if logprob is None else float(logprob),
        top=tuple((int(t), float(lp)) for t, lp in top),
        asked=tuple(float(lp) for lp in asked),
    )
