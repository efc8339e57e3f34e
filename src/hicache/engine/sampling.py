"""Choosing the next token of every sequence of a step from its logits, as one batch.

``sample_tokens`` takes the step's logits [rows, vocab] and every row's
parameters. Greedy rows (temperature 0, or below ``GREEDY_BELOW_TEMPERATURE``)
are one argmax over the batch. Sampled rows go together: temperature is a
[rows, 1] vector, one softmax gives every row's distribution, and each row
draws by inverse CDF with one uniform from its own generator, so a request with
a seed gets the same tokens whatever else is in the batch and wherever its row
is. The tokens of all rows are read back at once: one host sync per step.

Which tokens a sampled row may draw, with ``q`` its probabilities sorted in
descending order and ``S_j`` their running sum (float64):

- top-k keeps the ``k`` most likely tokens;
- top-p then keeps the smallest prefix whose mass reaches ``top_p`` of what
  top-k kept (the prefix of positions ``j`` with ``S_j - q_j < top_p * S_k``),
  and always the most likely token.

How a row finds that prefix depends on its parameters:

- ``top_k`` up to ``MAX_WINDOW_TOKENS``: a window of its most likely tokens
  from one ``torch.topk`` (per window size, a power of two fixed by its own
  ``top_k``, so the window never depends on the other rows);
- top-p without top-k, on the CPU: a window of ``TOP_P_WINDOW_TOKENS`` first
  (where reading back whether it held the nucleus costs no device sync); a row
  whose nucleus is larger, or too flat to fit, joins the next case;
- otherwise (top-k above the window, or top-p on a GPU): the whole row sorted
  (values only). The prefix becomes a probability threshold, so there, tokens
  tied with the least likely kept token are kept too;
- temperature alone: no sort, the whole row.

A row with nothing to draw from (a NaN or infinite logit, or every logit
-inf) gets no token: ``None``, for the caller to fail that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hicache.engine.api import SamplingParams

# Temperatures below this sample greedily. At 1e-5 two logits 1e-3 apart already differ by
# e^-100 in probability, far below what float32 sampling can tell from zero, so the draw is
# the argmax (short of an exact tie); far below it, ``logits / temperature`` overflows to
# inf (any temperature under ~1e-38 for logits of order 1) and softmax gives NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5

# Rows with a top_k up to this draw from a window of their most likely tokens; beyond it
# a torch.topk costs about what sorting the row does.
MAX_WINDOW_TOKENS = 1024
MIN_WINDOW_TOKENS = 64
# On the CPU a top-p row without top-k first tries this many tokens: a language model's
# nucleus is usually far smaller, and sorting a whole 50k vocabulary costs ~1 ms a row.
TOP_P_WINDOW_TOKENS = 256
# A draw over a whole row finds its block of this many tokens from the blocks' sums, then
# its token inside the block: two short cumulative sums instead of one over the vocabulary.
CDF_BLOCK_TOKENS = 256


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator (seeded when the request asks) or None for greedy."""
    if is_greedy(params):
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """The next token of every row of ``logits`` [rows, vocab] (float32).

    A row is greedy when its parameters say so or it has no generator; a sampled row
    takes exactly one uniform from its generator. None for a row whose logits hold a
    NaN or an infinity, or are all -inf: there is no distribution to draw from.
    """
    num_rows, vocab = logits.shape
    if len(params) != num_rows or len(generators) != num_rows:
        raise ValueError(
            f"{num_rows} rows of logits but {len(params)} parameters and "
            f"{len(generators)} generators"
        )
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    sampled = [  # (a greedy request has no generator: that test alone, most of the time)
        i for i, g in enumerate(generators) if g is not None and not is_greedy(params[i])
    ]
    if len(sampled) < num_rows:
        peak, tokens = logits.max(dim=-1)  # [rows] each; the greedy rows' token: the argmax
    else:  # the peak alone is several times faster
        peak = logits.amax(dim=-1)
        tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not sampled:
        valid = peak.abs() < torch.inf  # (False for NaN too; fewer operations than isfinite)
    else:
        device = logits.device
        rows = _SampledRows.of([params[i] for i in sampled], vocab, device)
        draws = [generators[i] for i in sampled]
        index = torch.tensor(sampled, dtype=torch.int64, device=device)
        chosen = logits if len(sampled) == num_rows else logits[index]  # [n, vocab]
        drawn = _draw(chosen, rows, draws)  # [n]
        tokens = tokens.index_copy(0, index, drawn)
        # A sampled row scales its logits first: a finite peak may overflow there.
        inv_temperature = torch.ones(num_rows, device=device)
        inv_temperature[index] = rows.inv_temperature[:, 0]
        valid = (peak * inv_temperature).abs() < torch.inf
    out: list[int | None] = torch.where(valid, tokens, -1).tolist()  # the one host sync
    return out if -1 not in out else [t if t != -1 else None for t in out]


@dataclass(frozen=True)
class _SampledRows:
    """The sampled rows' parameters, as vectors on the logits' device."""

    params: tuple[SamplingParams, ...]
    inv_temperature: torch.Tensor  # [n, 1] float32
    top_k: list[int]  # 0: off (also for a top_k covering the vocabulary)
    top_p: torch.Tensor  # [n] float64; 1 where off

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], vocab: int, device: torch.device
    ) -> _SampledRows:
        return cls(
            params=tuple(params),
            inv_temperature=torch.tensor(
                [[1.0 / p.temperature] for p in params], dtype=torch.float32, device=device
            ),
            top_k=[p.top_k if 0 < p.top_k < vocab else 0 for p in params],
            top_p=torch.tensor(
                [min(p.top_p, 1.0) for p in params], dtype=torch.float64, device=device
            ),
        )


def _draw(logits: torch.Tensor, rows: _SampledRows, generators: Sequence[torch.Generator | None]
          ) -> torch.Tensor:
    """One token per row of ``logits`` [n, vocab] (int64 [n], on their device)."""
    num_rows, vocab = logits.shape
    device = logits.device
    on_cpu = device.type == "cpu"  # where reading a tensor back costs no device sync
    # One uniform per row, from its own generator, whatever path the row takes below.
    uniform = torch.stack([
        torch.rand((), generator=g, device=g.device, dtype=torch.float64) for g in generators
        if g is not None
    ]).to(device)  # [n]
    # A row with a NaN or infinite logit is NaN here: it draws some token in range below
    # (every search is clamped) and the caller drops it.
    probs = torch.softmax(logits * rows.inv_temperature, dim=-1)  # [n, vocab]
    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)

    # A top-p window can only hold the nucleus if its size times the top probability
    # reaches top_p: a flat row goes to the sort at once.
    top_prob = probs.amax(dim=-1).tolist() if on_cpu else []
    windows: dict[int, list[int]] = {}  # window size -> rows
    whole: list[int] = []  # rows drawn over the whole vocabulary
    for i, p in enumerate(rows.params):
        k = rows.top_k[i]
        if 0 < k <= MAX_WINDOW_TOKENS:
            size = max(MIN_WINDOW_TOKENS, 1 << (k - 1).bit_length())
        elif k == 0 and p.top_p < 1.0 and on_cpu and TOP_P_WINDOW_TOKENS * top_prob[i] >= p.top_p:
            size = TOP_P_WINDOW_TOKENS
        else:
            whole.append(i)
            continue
        windows.setdefault(min(size, vocab), []).append(i)

    for size, members in windows.items():
        index = torch.tensor(members, dtype=torch.int64, device=device)
        chosen = probs if len(members) == num_rows else probs[index]  # [m, vocab]
        top, top_ids = torch.topk(chosen, size, dim=-1)  # [m, size] each, descending
        count, resolved = _nucleus(top.double().cumsum_(dim=-1),
                                   [rows.top_k[i] for i in members], rows.top_p[index])
        if on_cpu and not bool(resolved.all()):  # only top-p rows come unresolved
            short = resolved.logical_not().nonzero().flatten().tolist()
            whole.extend(members[j] for j in short)
        kept = top.masked_fill(torch.arange(size, device=device) >= count[:, None], 0.0)
        position = _inverse_cdf(kept, uniform[index])
        tokens[index] = top_ids.gather(1, position[:, None])[:, 0]

    if whole:
        whole.sort()
        index = torch.tensor(whole, dtype=torch.int64, device=device)
        chosen = probs if len(whole) == num_rows else probs[index]  # [m, vocab]
        cut = [i for i, row in enumerate(whole) if rows.top_k[row] or rows.params[row].top_p < 1]
        if cut:  # rows with temperature alone keep every token: no sort, no threshold
            # In place: the windows are done with ``probs``.
            _cut(chosen, cut, [rows.top_k[whole[i]] for i in cut], rows.top_p[index[cut]])
        tokens[index] = _inverse_cdf(chosen, uniform[index])
    return tokens


def _nucleus(
    total: torch.Tensor, top_k: Sequence[int], top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the most likely tokens each row keeps [m] (at least 1), from their
    running mass ``total`` [m, size] (float64, most likely first); and whether the cut
    falls inside them [m] (True for every row with top-k, whose ``k`` tokens they hold).

    Position j is kept while the mass before it, ``total[j - 1]``, is under the target:
    the count is one more than the positions whose running mass is under it.
    """
    size = total.shape[-1]
    device = total.device
    k = torch.tensor([min(k, size) if k > 0 else size for k in top_k], device=device)
    has_top_k = torch.tensor([k > 0 for k in top_k], device=device)
    # Top-p is a share of what top-k kept; of the whole distribution (1) without top-k.
    kept_mass = torch.where(has_top_k, total.gather(1, (k - 1)[:, None])[:, 0], 1.0)
    target = torch.where(top_p < 1.0, top_p * kept_mass, torch.inf)  # [m]
    under = torch.searchsorted(total, target[:, None], right=False)[:, 0]  # [m]
    # At least the most likely token: a top_p too small for float64 (1e-300 * mass) is 0.
    count = torch.minimum(under + 1, k).clamp_(min=1)
    resolved = has_top_k | (total[:, -1] >= target)
    return count, resolved


def _cut(
    probs: torch.Tensor, rows: list[int], top_k: Sequence[int], top_p: torch.Tensor
) -> None:
    """Set to 0, in rows ``rows`` of ``probs`` [m, vocab], the tokens top-k and top-p drop:
    those less likely than the least likely token of the prefix they keep."""
    index = torch.tensor(rows, dtype=torch.int64, device=probs.device)
    chosen = probs if len(rows) == len(probs) else probs[index]  # [c, vocab]
    if chosen.device.type == "cpu":
        # NumPy's float32 sort is vectorised and several times faster than torch's; read
        # backwards, its order is the most likely first.
        ascending = np.sort(chosen.numpy(), axis=-1)
        total = torch.from_numpy(np.cumsum(ascending[:, ::-1], axis=-1, dtype=np.float64))
        count, _ = _nucleus(total, top_k, top_p)
        # The least likely kept token's probability, and the float32 just below it.
        least = ascending[np.arange(len(rows)), ascending.shape[-1] - count.numpy()]
        limits = np.nextafter(least, np.float32(0)).tolist()
        # F.threshold (keeping what is above the limit), in place, is many times faster
        # on the CPU than torch.where.
        for row, limit in zip(rows, limits, strict=True):
            F.threshold(probs[row], limit, 0.0, inplace=True)
        return
    ordered = torch.sort(chosen, dim=-1, descending=True).values
    count, _ = _nucleus(ordered.double().cumsum_(dim=-1), top_k, top_p)
    least = ordered.gather(1, (count - 1)[:, None])  # [c, 1]
    probs[index] = torch.where(chosen >= least, chosen, 0.0)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` [m, n] (non-negative, not normalised), the position whose
    cumulative weight first exceeds ``uniform`` [m] (float64 in [0, 1)) of the row's
    total: a draw in proportion to the weights, never of a zero weight (except in an
    all-zero row, which gets some position in range)."""
    num_rows, width = weights.shape
    if width <= 2 * CDF_BLOCK_TOKENS:
        cumulative = weights.double().cumsum_(dim=-1)
        return _search(cumulative, uniform * cumulative[:, -1])
    pad = -width % CDF_BLOCK_TOKENS
    padded = F.pad(weights, (0, pad)) if pad else weights
    blocks = padded.view(num_rows, -1, CDF_BLOCK_TOKENS)  # [m, nb, block]
    block_cumulative = blocks.sum(dim=-1).double().cumsum_(dim=-1)  # [m, nb]
    target = uniform * block_cumulative[:, -1]
    block = _search(block_cumulative, target)  # [m]
    before = torch.where(
        block > 0, block_cumulative.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0
    )
    inside = blocks[torch.arange(num_rows, device=weights.device), block]  # [m, block]
    # The block's float32 sum and its float64 running sum may disagree in the last bit:
    # _search clamps to the block's last token with weight, which the block has.
    position = _search(inside.double().cumsum_(dim=-1), target - before)
    return block * CDF_BLOCK_TOKENS + position


def _search(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of ``cumulative`` [m, n] (non-decreasing), the first position above
    ``target`` [m], but no later than the last position with weight (where the total is
    first reached), for a target rounded up to the total."""
    position = torch.searchsorted(cumulative, target[:, None], right=True)
    last = torch.searchsorted(cumulative, cumulative[:, -1:].contiguous(), right=False)
    # (NaN rows: in range all the same.)
    return torch.minimum(position, last)[:, 0].clamp_(max=cumulative.shape[-1] - 1)
