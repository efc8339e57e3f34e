"""The host tier's core set in the engine: conversations taking turns in a loop larger
than the host pool keep hitting with it (and answer as cold), and never without it."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from hicache.engine.engine import Engine
from tests.engine_helpers import run
from tests.integration.engine.test_engine_cache_reuse import assert_same

PAGE = 16
CONVERSATIONS = 5
ROUNDS = 5
FIRST_TURN = 160  # 10 pages
QUESTION = 28  # a turn adds its 4-token answer and a 28-token question: 2 pages
# 32 device pages and 64 host pages (write-through: the host holds what the device does):
# five conversations need 70 pages by round 3 and 90 by round 5.
FLAGS = (
    "--page-size", str(PAGE), "--max-total-tokens", str(32 * PAGE),
    "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-reuse-policy", "load",
    "--max-running-requests", "1",
)


def loop(engine: Engine) -> tuple[list[int], list[tuple[list[int], object]]]:
    """The conversations taking turns in a fixed order; returns the tokens served from
    the cache in each round, and the last round's prompts with their answers."""
    rng = random.Random(3)
    histories = [[rng.randrange(256) for _ in range(FIRST_TURN)] for _ in range(CONVERSATIONS)]
    cached = []
    last = []
    for r in range(ROUNDS):
        total = 0
        for c in range(CONVERSATIONS):
            prompt = histories[c]
            answer = run(engine, prompt, logits=True, max_new_tokens=4, ignore_eos=True)
            total += answer.outputs[-1].cached_tokens.total
            if r == ROUNDS - 1:
                last.append((prompt, answer))
            histories[c] = prompt + answer.token_ids + [rng.randrange(256) for _ in range(QUESTION)]
        cached.append(total)
    engine.check_integrity()
    return cached, last


def test_without_a_core_set_the_loop_never_hits(make_engine: Callable[..., Engine]) -> None:
    cached, _ = loop(make_engine(*FLAGS, "--hicache-core-fraction", "0"))
    assert cached[3:] == [0, 0]


@pytest.mark.parametrize("fraction", ["0.5", "0.75"])
def test_the_core_set_keeps_hitting_and_answers_as_cold(
    make_engine: Callable[..., Engine], fraction: str,
) -> None:
    engine = make_engine(*FLAGS, "--hicache-core-fraction", fraction)
    cached, last = loop(engine)
    core_tokens = int(float(fraction) * 64) * PAGE
    # Every round from the third on serves at least most of the core set's pages (the
    # conversations' earliest pages, kept through every cycle).
    for total in cached[3:]:
        assert total >= core_tokens * 3 // 4, cached
    assert engine.cache.tree.num_core_pages == int(float(fraction) * 64)
    cold = make_engine("--page-size", str(PAGE), "--disable-radix-cache")
    for prompt, answer in last:
        if answer.outputs[-1].cached_tokens.total:
            assert_same(run(cold, prompt, logits=True, max_new_tokens=4, ignore_eos=True),
                        answer, tolerance=1e-4)
