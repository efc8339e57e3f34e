"""From a step's logits to each request's next token: adjust, sample, take.

After a forward, ``PostProcessor.take_tokens`` gets the rows of the requests that
have their next token to choose: their logits are adjusted for the whole batch at
once (penalties, the min_new_tokens mask, grammar masks; ``penalties.py``), sampled
in one batch with one host sync (``sampling.py``), and each token goes to its
request (``RequestLifecycle.append_token``), which streams it or finishes the
request. Prompt logprobs are kept as the prompt's chunks are computed
(``record_prompt_logprobs``).

Invariants:

- logprobs are those of the model's raw distribution; tokens are drawn from the
  adjusted one (what ``logits_observer`` sees);
- a request's fault fails that request alone: when adjusting or sampling the batch
  raises, each row is adjusted and sampled on its own (a seeded request drew its
  uniform in the failed batch already, so its draw there is the next one), and a
  request whose logits hold nothing to sample, or whose token cannot be taken (a
  detokenizer error, a grammar refusing it), finishes aborted with the reason while
  the batch goes on;
- a request with no penalty, mask or sampling takes its argmax with no row of its
  own copied or reported (the common decode step stays lean).

Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from hicache.engine.lifecycle import RequestLifecycle
from hicache.engine.logprobs import position_logprobs
from hicache.engine.penalties import PenaltyState, RowAdjustment, adjust_logits, ending_tokens
from hicache.engine.request import Phase, Req
from hicache.engine.sampling import sample_tokens

logger = logging.getLogger(__name__)


class PostProcessor:
    def __init__(
        self, lifecycle: RequestLifecycle, eos_token_ids: frozenset[int], device: torch.device
    ) -> None:
        self.lifecycle = lifecycle
        self.eos_token_ids = eos_token_ids
        self.device = device
        # Sees the logits each sampled token came from (tests compare cold and cached runs).
        self.logits_observer: Callable[[str, torch.Tensor], None] | None = None

    # ------------------------------------------------------ prompt logprobs
    @staticmethod
    def logits_from(req: Req, n: int) -> int:
        """The first of the ``n`` tokens it computes this step whose logits it needs: the
        last (it samples from it), or earlier ones for the prompt's logprobs."""
        if not req.wants_input_logprobs:
            return n - 1
        # The row at position j gives the logprob of the token at j + 1.
        return min(max(req.logprob_next - 1 - req.num_computed, 0), n - 1)

    def record_prompt_logprobs(
        self, plan: list[tuple[Req, int]], logits: torch.Tensor,
        logits_from: list[int] | None,
    ) -> list[tuple[int, Req]]:
        """Advance the plan's requests, keeping the prompt logprobs some asked for; the
        (row of its last logits, request) of each that has its next token to choose."""
        done: list[tuple[int, Req]] = []
        failed: list[tuple[Req, str]] = []
        offset = 0
        for index, (req, n) in enumerate(plan):
            first = logits_from[index] if logits_from is not None else n - 1
            num_rows = n - first
            if req.wants_input_logprobs:
                error = self._record_input_logprobs(req, logits[offset : offset + num_rows],
                                                    req.num_computed + first)
                if error is not None:
                    failed.append((req, error))
            req.num_computed += n
            if req.num_computed == req.seq_len:
                done.append((offset + num_rows - 1, req))
            offset += num_rows
        for req, error in failed:
            self.lifecycle.fail(req, error)
        return [(row, req) for row, req in done if req.phase is not Phase.FINISHED]

    def _record_input_logprobs(
        self, req: Req, logits: torch.Tensor, first_position: int
    ) -> str | None:
        """Keep the prompt logprobs that ``logits`` [rows, vocab] (positions from
        ``first_position``) give; the error's text if that failed (for this request alone)."""
        params = req.request.logprobs
        assert params is not None
        if first_position + 1 != req.logprob_next:  # match_tokens() makes this impossible
            return f"prompt logprobs from {req.logprob_next} missed: computed from " \
                f"{first_position + 1}"
        count = min(len(logits), req.prompt_len - req.logprob_next)
        next_ids = req.request.input_ids[req.logprob_next : req.logprob_next + count]
        try:
            req.input_logprobs.extend(position_logprobs(logits[:count], next_ids, params))
        except Exception as error:  # one request's fault must not fail the others
            logger.exception("request %s failed computing its prompt logprobs", req.rid)
            return f"internal error computing prompt logprobs: {type(error).__name__}: {error}"
        req.logprob_next += count
        return None

    # ------------------------------------------------------------ the tokens
    def take_tokens(self, logits: torch.Tensor, done: list[tuple[int, Req]]) -> None:
        """Choose and take the next token of every request in ``done`` (row of its last
        logits in ``logits`` [rows, vocab], request), in that order; a request whose
        prompt this step completed decodes from now on (``end_prefill``)."""
        if len(done) == len(logits):  # every row, in order (a decode step): no copy
            chosen = logits.float()  # [num_done, vocab], as the model gave them
        else:
            chosen = logits[torch.tensor([row for row, _ in done], device=logits.device)].float()
        reqs = [req for _, req in done]
        source = self._adjusted(chosen, reqs)  # [num_done, vocab]: what tokens come from
        drawn = self._sample(source, reqs) if source is not None else None
        plain = self.logits_observer is None
        now = time.monotonic()
        decode = Phase.DECODE
        lifecycle = self.lifecycle
        append = lifecycle.append_token
        for index, req in enumerate(reqs):
            if req.phase is not decode and not lifecycle.end_prefill(req):
                continue
            if req.first_token_at is None:
                req.first_token_at = now
            if drawn is None or source is None:
                self._next_token_alone(req, chosen[index])
                continue
            token = drawn[index]
            if plain and req.plain_greedy and token is not None:
                # The argmax is its token: no row of its own to observe or report.
                try:
                    append(req, token)
                except Exception as error:  # one request's fault must not fail the others
                    lifecycle.token_failed(req, error)
                continue
            self._next_token(req, chosen[index], source[index], token)

    def _adjustment(self, req: Req, vocab_size: int) -> RowAdjustment:
        params = req.request.sampling
        if params.has_penalties and req.penalties is None:
            req.penalties = PenaltyState(
                req.request.input_ids if params.repetition_penalty != 1.0 else (),
                vocab_size, self.device,
            )
        banned: tuple[int, ...] = ()
        if len(req.output_ids) < params.min_new_tokens:
            banned = ending_tokens(params, self.eos_token_ids)
        return RowAdjustment(params, req.penalties, banned, req.grammar)

    def _adjusted(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor | None:
        """The rows with penalties and min_new_tokens applied, for the whole batch at once
        (``logits`` itself when none needs it); None when that failed (each request then
        adjusts and samples its own row, so that a faulty one fails alone)."""
        if all(req.plain_greedy for req in reqs):
            return logits  # the common case: no penalty, no mask, no sampling
        try:
            rows = [self._adjustment(req, logits.shape[-1]) for req in reqs]
            if all(row.is_noop for row in rows):
                return logits
            return adjust_logits(logits, rows)
        except Exception:
            logger.exception("adjusting the batch's logits failed; adjusting row by row")
            return None

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int | None] | None:
        """Every request's next token from its row of ``logits`` [rows, vocab], in one batch
        (None for a row with nothing to draw from); None when that failed (each request
        then samples its own row, so that a faulty one fails alone)."""
        try:
            return sample_tokens(
                logits, [req.request.sampling for req in reqs], [req.generator for req in reqs]
            )
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
            return None

    def _next_token_alone(self, req: Req, logits: torch.Tensor) -> None:
        """Adjust and sample the one row ``logits`` [vocab] of ``req``, then take its token:
        the way back when doing that for the batch failed. (A seeded request drew its
        uniform in the failed batch already, so its draw here is the next one.)"""
        try:
            row = self._adjustment(req, logits.shape[-1])
            sampled_from = logits if row.is_noop else adjust_logits(logits[None], [row])[0]
            token = sample_tokens(sampled_from[None], [req.request.sampling], [req.generator])[0]
        except Exception as error:  # one request's fault must not fail the others
            self.lifecycle.token_failed(req, error)
            return
        self._next_token(req, logits, sampled_from, token)

    def _next_token(
        self, req: Req, logits: torch.Tensor, sampled_from: torch.Tensor, token: int | None
    ) -> None:
        """Append, detokenize, stop and stream one request's ``token``.

        ``logits`` [vocab] are the model's (its logprobs come from them), ``sampled_from``
        the same with the request's penalties and masks applied, ``token`` what was drawn
        from them: None when they hold a NaN or an infinity, or are all -inf.

        All of it concerns this request alone, so a failure here (a detokenizer error on
        its tokens, logits with nothing to sample) fails this request alone: its KV is
        valid and goes to the tree as on any finish, and the batch goes on.
        """
        lifecycle = self.lifecycle
        if token is None:
            logger.error("request %s: its logits hold NaN or infinity, or are all -inf",
                         req.rid)
            lifecycle.fail(req, "cannot produce the next token: the logits to sample it from "
                           "hold NaN or infinity, or are all -inf")
            return
        try:
            if self.logits_observer is not None:
                self.logits_observer(req.rid, sampled_from.cpu())
            if req.request.logprobs is not None:
                req.output_logprobs.extend(
                    position_logprobs(logits[None], [token], req.request.logprobs)
                )
            lifecycle.append_token(req, token)
        except Exception as error:  # one request's fault must not fail the others
            lifecycle.token_failed(req, error)
