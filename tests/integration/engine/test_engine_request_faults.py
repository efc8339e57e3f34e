"""One request's fault is its own: it never fails the requests batched with it.

A temperature too small to divide by samples greedily instead of overflowing,
and a request whose sampling or detokenizing raises is failed alone, with its
pages freed, while the others finish exactly as they would have alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import hicache.engine.engine as engine_module
import hicache.engine.postprocess as postprocess_module
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.engine.sampling import make_generator, sample_tokens
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.detokenizer import IncrementalDetokenizer
from tests.engine_helpers import run, run_many

FAILING_SEED = 13  # the request whose sampler the sampler fault hits
FLAGS = ("--page-size", "4", "--max-total-tokens", "1024")


def prompt(seed: int, length: int = 40) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def request(ids: list[int], n: int = 12, **sampling: object) -> GenerateRequest:
    params = SamplingParams(**{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,  # type: ignore[arg-type]
                               **sampling})
    return GenerateRequest(tuple(ids), params)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.999]])
    params = SamplingParams(temperature=temperature, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    assert generator is None
    # Even with a generator (a caller that made one itself) the row is not divided by it.
    own = torch.Generator().manual_seed(0)
    assert sample_tokens(logits, [params], [own]) == [1]


def test_a_tiny_temperature_gets_the_greedy_answer_while_others_run(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    others = [request(prompt(10 + i), n=10 + i) for i in range(3)]
    solo = [run(engine, list(r.input_ids), ignore_eos=True,
                max_new_tokens=r.sampling.max_new_tokens).token_ids for r in others]
    tiny_ids = prompt(20)
    greedy = run(engine, tiny_ids, ignore_eos=True, max_new_tokens=12).token_ids

    results = run_many(engine, [*others, request(tiny_ids, temperature=1e-40, seed=5)])
    assert all(r.last.error is None for r in results), [r.last for r in results]
    assert [r.token_ids for r in results[:3]] == solo
    assert results[3].token_ids == greedy
    assert results[3].last.finish_reason == "length"
    engine.check_integrity()


class _FailingDetokenizer(IncrementalDetokenizer):
    """Raises on the fourth token of the prompt it is told to fail (a tokenizer bug)."""

    failing_prompt: tuple[int, ...] = ()

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        super().__init__(tokenizer, prompt_ids)
        self._fails = tuple(prompt_ids) == self.failing_prompt
        self._pushed = 0

    def push(self, token: int) -> str:
        self._pushed += 1
        if self._fails and self._pushed == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return super().push(token)


@pytest.mark.parametrize("where", ["detokenizer", "sampler"])
def test_a_request_failing_mid_step_fails_alone(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    engine = make_engine(*FLAGS)
    others = [request(prompt(30 + i), n=14 + i) for i in range(4)]
    solo = [run(engine, list(r.input_ids), ignore_eos=True,
                max_new_tokens=r.sampling.max_new_tokens).token_ids for r in others]
    failing_ids = prompt(40, length=50)
    failing = request(failing_ids, n=20, temperature=1.0, seed=FAILING_SEED)
    failed_sizes: list[int] = []  # rows of each sampler call that raised
    if where == "detokenizer":
        monkeypatch.setattr(_FailingDetokenizer, "failing_prompt", tuple(failing_ids))
        monkeypatch.setattr(engine_module, "IncrementalDetokenizer", _FailingDetokenizer)
    else:
        real = postprocess_module.sample_tokens
        calls = 0

        def faulty(logits: torch.Tensor, params: Sequence[SamplingParams],
                   generators: Sequence[torch.Generator | None]) -> list[int | None]:
            # The 4th call with the failing request's row raises: the step's batch call;
            # the scheduler then samples each row alone, and the 5th (its own) raises too.
            nonlocal calls
            if any(p.seed == FAILING_SEED for p in params):
                calls += 1
                if calls in (4, 5):
                    failed_sizes.append(len(params))
                    raise RuntimeError("probability tensor contains either inf or nan")
            return real(logits, params, generators)

        monkeypatch.setattr(postprocess_module, "sample_tokens", faulty)

    # The failing request in the middle of the batch, mid-decode when it fails.
    results = run_many(engine, [*others[:2], failing, *others[2:]])
    rest = results[:2] + results[3:]
    assert all(r.last.error is None and r.last.finish_reason == "length" for r in rest), (
        [r.last.error for r in rest]
    )
    assert [r.token_ids for r in rest] == solo
    if where == "sampler":
        assert failed_sizes[0] > 1 and failed_sizes[1:] == [1]  # the batch, then its row
    bad = results[2]
    assert bad.last.finished and bad.last.finish_reason == "abort"
    assert bad.last.error is not None and "next token" in bad.last.error
    # The sampler failed on its 4th token; the detokenizer on the 4th, already sampled.
    assert len(bad.token_ids) == (3 if where == "sampler" else 4)
    counters = engine.scheduler.counters
    assert counters.num_aborted == 1
    # Its pages went back (its computed KV to the tree), and the engine still serves it.
    engine.check_integrity()
    pool = engine.cache.device_pool.allocator
    assert pool.num_used_pages == engine.cache.tree.num_evictable_device_pages
    monkeypatch.undo()
    again = run(engine, failing_ids, ignore_eos=True, max_new_tokens=4)
    assert again.last.error is None and again.last.cached_tokens.device > 0
