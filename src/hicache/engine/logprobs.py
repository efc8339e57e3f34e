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
