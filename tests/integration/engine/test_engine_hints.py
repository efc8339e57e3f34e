"""Hints on a real engine (tiny model, CPU, L2 + file L3): a pinned prefix and a retained
one survive host-pool pressure that evicts an unhinted one, and the next request on each
is a host hit whose greedy answer equals the cold one; a request's own hints come back
in its final output; prefetch and a pin of a prefix only L3 holds bring it back to the
host in the background."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import torch

from hicache.engine.api import (
    GenerateRequest,
    Hint,
    HintKind,
    HintOutcomeKind,
    SamplingParams,
)
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect, on_scheduler, run
from tests.integration.engine.test_engine_cache_reuse import assert_same
from tests.waiting import wait_until

PAGE = 16
PROMPT_LEN = 321  # 20 whole pages and one token
REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
# 64 device pages, 96 host pages: pins may hold 48 in all, 24 per tenant. Hints against
# least-recently-used eviction alone: a host core set would keep the unhinted prefix too.
FLAGS = (
    "--page-size", str(PAGE), "--max-total-tokens", "1024", "--enable-hierarchical-cache",
    "--hicache-ratio", "1.5", "--hicache-reuse-policy", "load", "--hicache-core-fraction", "0",
)
SETTLE_S = 60.0  # a guard against a hang, far above what a busy machine needs


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PROMPT_LEN,), generator=generator).tolist()


def with_file_l3(path: Path) -> tuple[str, ...]:
    config = {"path": str(path), "prefetch_threshold": PAGE}
    return (*FLAGS, "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps(config))


def run_hinted(engine: Engine, ids: list[int], hints: tuple[Hint, ...]) -> Run:
    """``run`` with the request's own hints (and the logits of its tokens)."""
    seen: list[torch.Tensor] = []
    engine.scheduler.postprocess.logits_observer = lambda rid, row: seen.append(row)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        result = asyncio.run(collect(engine, GenerateRequest(tuple(ids), params, hints=hints)))
    finally:
        engine.scheduler.postprocess.logits_observer = None
    result.logits = seen
    return result


def local_tokens(engine: Engine, ids: list[int]) -> tuple[int, int]:
    """(device, host) tokens of ``ids`` cached in L1 / L2 only."""
    peek = on_scheduler(engine, lambda: engine.cache.peek(ids))
    return peek.num_device_tokens, peek.num_host_tokens  # type: ignore[attr-defined]


def test_pinned_and_retained_prefixes_survive_pressure_and_answer_as_cold(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*with_file_l3(tmp_path / "l3"))
    pinned, retained, plain = prompt(1), prompt(2), prompt(3)
    cold = {seed: run(engine, ids, logits=True, ignore_eos=True)
            for seed, ids in ((1, pinned), (3, plain))}
    # The retained prefix is hinted by its own request, applied as it finishes.
    cold[2] = run_hinted(engine, retained, (Hint(HintKind.RETAIN, ttl_s=3600.0),))
    [own] = cold[2].last.hints or []
    assert (own.kind, own.outcome) == (HintKind.RETAIN, HintOutcomeKind.ACCEPTED)
    assert own.tokens >= REUSED
    [pin] = engine.apply_hints([Hint(HintKind.PIN, tuple(pinned), tenant="t")])
    assert (pin.outcome, pin.tokens) == (HintOutcomeKind.ACCEPTED, REUSED), pin
    status = engine.hint_status()
    assert status["pinned_pages"] == REUSED // PAGE
    assert status["pinned_pages_by_tenant"] == {"t": REUSED // PAGE}
    assert status["outcomes"] == {"retain/accepted": 1, "pin/accepted": 1}

    for seed in range(10, 18):  # 8 x 20 pages through a host pool of 96
        run(engine, prompt(seed), max_new_tokens=1)
    engine.evict_device_cache()
    assert local_tokens(engine, plain) == (0, 0)
    assert local_tokens(engine, pinned) == (0, REUSED)
    assert local_tokens(engine, retained) == (0, REUSED)

    for seed, ids in ((1, pinned), (2, retained)):
        again = run(engine, ids, logits=True, ignore_eos=True)
        cached = again.last.cached_tokens
        assert (cached.device, cached.host, cached.storage) == (0, REUSED, 0), cached
        assert again.token_ids == cold[seed].token_ids
        assert_same(cold[seed], again)
    engine.check_integrity()


def test_prefetch_and_a_deferred_pin_bring_l3_pages_to_the_host(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*with_file_l3(tmp_path / "l3"))
    fetched, pinned = prompt(1), prompt(2)
    cold = {1: run(engine, fetched, logits=True, ignore_eos=True),
            2: run(engine, pinned, logits=True, ignore_eos=True)}
    assert engine.flush_cache()  # L3 alone holds them now
    assert local_tokens(engine, fetched) == (0, 0)
    prefetch, pin = engine.apply_hints([
        Hint(HintKind.PREFETCH, tuple(fetched)), Hint(HintKind.PIN, tuple(pinned)),
    ])
    assert (prefetch.outcome, prefetch.tokens) == (HintOutcomeKind.DEFERRED, REUSED)
    assert pin.outcome is HintOutcomeKind.DEFERRED
    assert wait_until(lambda: local_tokens(engine, fetched)[1] == REUSED, SETTLE_S)
    assert wait_until(lambda: engine.hint_status()["pinned_pages"] == REUSED // PAGE, SETTLE_S)
    [again] = engine.apply_hints([Hint(HintKind.PREFETCH, tuple(fetched))])
    assert (again.outcome, again.reason) == (HintOutcomeKind.ACCEPTED, "already cached")
    for seed, ids in ((1, fetched), (2, pinned)):
        answer = run(engine, ids, logits=True, ignore_eos=True)
        assert answer.last.cached_tokens.host == REUSED
        assert_same(cold[seed], answer)
    engine.check_integrity()
