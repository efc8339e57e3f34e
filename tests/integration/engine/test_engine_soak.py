"""A soak through every tier: conversations at once, clients leaving, eviction down to L3.

Eight conversations on two shared system prompts take turns in rounds, all of a
round's requests at once, while about one client in five leaves after its first
token. The conversations' KV outgrows the host pool (about twice the device
pool), so prefixes keep moving L1 -> L2 -> L3 and back. Every answer
that completed must equal the same prompt answered cold by an engine without a
prefix cache; afterwards every pool is consistent and nothing is leaked.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, on_scheduler, run, wait_idle
from tests.integration.engine.test_engine_cache_reuse import assert_same
from tests.kv_oracle import settle

ROUNDS = 5
CONVERSATIONS = 8
ANSWER_TOKENS = 6
LEAVE_PROBABILITY = 0.2


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(256) for _ in range(count)]


def soak_engine_flags(
    backend: str, extra: dict[str, Any], policy: str, layout: str, prefetch: str,
    core_fraction: float = 0.0,
) -> tuple[str, ...]:
    """An engine whose pools the soak's conversations outgrow, over the L3 ``backend``.

    The workload is sized for least-recently-used eviction to drop prefixes from both
    local tiers before their next turn, so that L3 serves some: with a host core set
    (``core_fraction``) the host tier keeps them instead."""
    extra = {**extra, "prefetch_threshold": 8, "prefetch_timeout_base": 0.05}
    return (
        "--hicache-core-fraction", str(core_fraction),
        "--hicache-write-policy", policy, "--hicache-mem-layout", layout,
        "--hicache-storage-prefetch-policy", prefetch,
        "--page-size", "4", "--max-total-tokens", "320", "--enable-hierarchical-cache",
        "--hicache-ratio", "2", "--hicache-storage-backend", backend,
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--max-running-requests", "4", "--chunked-prefill-size", "48",
    )


async def one_turn(engine: Engine, request: GenerateRequest, leave: bool) -> Run:
    """What the client read: the whole answer, or the first output of one that went away."""
    outputs = []
    stream = engine.generate(request)
    async for output in stream:
        outputs.append(output)
        if leave:
            await stream.aclose()  # what the server does when the client disconnects
            break
    return Run(outputs)


async def one_round(
    engine: Engine, requests: list[GenerateRequest], leaving: set[int]
) -> list[Run]:
    return list(
        await asyncio.gather(
            *(one_turn(engine, r, i in leaving) for i, r in enumerate(requests))
        )
    )


@pytest.mark.parametrize(
    ("policy", "layout", "prefetch"),
    [
        ("write_through", "layer_first", "wait_complete"),
        ("write_through", "page_first", "wait_complete"),
        ("write_through", "page_first_direct", "best_effort"),
        ("write_through_selective", "layer_first", "timeout"),
        ("write_through_selective", "page_first", "wait_complete"),
        ("write_back", "layer_first", "wait_complete"),
        ("write_back", "page_first", "best_effort"),
        ("write_back", "page_first_direct", "timeout"),
    ],
)
def test_conversations_with_clients_leaving_answer_as_cold_through_every_tier(
    make_engine: Callable[..., Engine], tmp_path: Path, policy: str, layout: str, prefetch: str,
) -> None:
    every_tier = policy == "write_through" and prefetch == "wait_complete"
    # Where L3 need not serve, the host tier keeps its default core set.
    flags = soak_engine_flags(
        "file", {"path": str(tmp_path / "l3")}, policy, layout, prefetch,
        core_fraction=0.0 if every_tier else 0.75,
    )
    soak(make_engine, flags, expect_storage_hits=every_tier)


def test_salted_conversations_answer_as_cold_through_every_tier(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    """Three cache salts over the same system prompts, through every tier: answers stay cold's."""
    flags = soak_engine_flags(
        "file", {"path": str(tmp_path / "l3")}, "write_through", "page_first", "wait_complete"
    )
    soak(make_engine, flags, expect_storage_hits=True, salts=3)


def soak(
    make_engine: Callable[..., Engine], flags: tuple[str, ...], expect_storage_hits: bool,
    salts: int = 0,
) -> None:
    """Run the conversations on an engine built with ``flags``; check them against cold.

    With ``salts``, conversation c sends cache salt c % salts (requests with different
    salts never share KV, so the answers must still be the cold ones).
    """
    engine = make_engine(*flags)
    rng = random.Random(11)
    systems = [tokens(rng, 32) for _ in range(2)]
    histories = [systems[c % 2] + tokens(rng, rng.randint(40, 80)) for c in range(CONVERSATIONS)]
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    engine.scheduler.postprocess.logits_observer = lambda rid, row: logits[rid].append(row)
    completed: list[tuple[list[int], Run]] = []
    num_left = 0
    for round_index in range(ROUNDS):
        prompts = [history + tokens(rng, rng.randint(8, 20)) for history in histories]
        leaving = {c for c in range(CONVERSATIONS) if rng.random() < LEAVE_PROBABILITY}
        params = SamplingParams(max_new_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
        requests = [
            GenerateRequest(
                tuple(p), params, rid=f"r{round_index}c{c}",
                extra_key=f"salt{c % salts}" if salts else None,
            )
            for c, p in enumerate(prompts)
        ]
        answers = asyncio.run(one_round(engine, requests, leaving))
        for c, answer in enumerate(answers):
            # Nobody is failed: not for a full pool, not for lack of pages, not for anything.
            assert all(output.error is None for output in answer.outputs), answer.last
            if c in leaving:
                num_left += 1
                continue
            answer.logits = logits[requests[c].rid]
            completed.append((prompts[c], answer))
            histories[c] = prompts[c] + answer.token_ids
        # Between rounds (as between a user's turns) copies and backups finish, so that
        # which tier serves the next round does not depend on this machine's speed.
        wait_idle(engine)
        on_scheduler(engine, lambda: settle(engine.cache))
    engine.scheduler.postprocess.logits_observer = None
    assert num_left > 0 and len(completed) > ROUNDS * CONVERSATIONS // 2

    # Hits came from every tier (the workload is sized for it). Under the other write
    # policies a prefix reaches L2 (and so L3) later (at its second hit, or when L1 evicts
    # it), and whether one then falls out of both local tiers before its next turn depends
    # on the order a round's requests ran in; the other prefetch policies may not wait.
    by_tier = [answer.last.cached_tokens for _, answer in completed]
    assert sum(c.device for c in by_tier) > 0
    assert sum(c.host for c in by_tier) > 0
    if expect_storage_hits:
        assert sum(c.storage for c in by_tier) > 0, engine.storage_status()

    cold_engine = make_engine("--page-size", "4", "--disable-radix-cache")
    for prompt, answer in completed:
        cold = run(cold_engine, prompt, logits=True, max_new_tokens=ANSWER_TOKENS, ignore_eos=True)
        assert cold.last.cached_tokens.total == 0
        assert_same(cold, answer, tolerance=1e-4)

    wait_idle(engine)
    # A client that left may have been answered in full before its abort reached the
    # scheduler (six tokens are quickly made): that request finished instead of aborting.
    counters = engine.scheduler.counters
    assert 0 < counters.num_aborted <= num_left
    assert counters.num_aborted + counters.num_finished == counters.num_requests
    engine.check_integrity()
    device = engine.cache.device_pool.allocator
    assert device.num_used_pages == engine.cache.tree.num_evictable_device_pages
