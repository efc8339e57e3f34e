"""A waiting request keeps its cached prefix while the prefills ahead of it evict pages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

import hicache.engine.scheduler as scheduler_module
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect, run

PAGE = 16
PROMPT_LEN = 321  # 20 whole pages and one token
REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
# 64 device pages and 96 host pages (write-through: every page computed is copied to the
# host, and only pages off the device are evicted from it): four finished prompts fill 80
# host pages, the two new prompts ahead of the turn need 40 more, so 24 are evicted while
# it waits.
FLAGS = (
    "--page-size", str(PAGE), "--max-total-tokens", "1024", "--enable-hierarchical-cache",
    "--hicache-ratio", "1.5", "--hicache-reuse-policy", "load", "--max-running-requests", "1",
    # Least-recently-used order alone: a core set would keep the first turn's pages anyway.
    "--hicache-core-fraction", "0",
)


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def greedy(ids: list[int], n: int = 4) -> GenerateRequest:
    return GenerateRequest(
        tuple(ids), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    )


def second_turn_behind_two_prefills(engine: Engine) -> Run:
    """A conversation's first turn, then three other prompts (its pages, moved off the
    device, are the least recently used), then, while a short prompt decodes at length
    (one request runs at a time), two new prompts and its second turn queue behind it:
    the second turn's answer."""
    first = prompt(1)
    run(engine, first, max_new_tokens=4, ignore_eos=True)
    for seed in (2, 3, 4):
        run(engine, prompt(seed), max_new_tokens=4, ignore_eos=True)

    async def queued() -> list[Run]:
        # One page of prompt and 13 of decode: room on the host without evicting.
        running = engine.generate(greedy(prompt(8, 9), n=200))
        await anext(running)
        requests = [greedy(prompt(5)), greedy(prompt(6)), greedy(first + prompt(7, 40))]
        answers = [asyncio.ensure_future(collect(engine, r)) for r in requests]
        async for _ in running:
            pass
        return list(await asyncio.gather(*answers))

    *_, second = asyncio.run(queued())
    engine.check_integrity()
    return second


def test_a_queued_turn_finds_its_earlier_turns_pages(make_engine: Callable[..., Engine]) -> None:
    second = second_turn_behind_two_prefills(make_engine(*FLAGS))
    assert second.outputs[-1].cached_tokens.total == REUSED
    assert second.outputs[-1].cached_tokens.host == REUSED  # off the device, kept on host


def test_without_the_touch_plain_lru_evicts_them(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same with no waiting prefix kept: the pages, least recently used, go first."""
    monkeypatch.setattr(scheduler_module, "KEEP_WAITING_PREFIXES", 0)
    second = second_turn_behind_two_prefills(make_engine(*FLAGS))
    assert second.outputs[-1].cached_tokens.total < REUSED
