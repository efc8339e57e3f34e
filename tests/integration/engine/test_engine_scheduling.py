"""Scheduling: continuous batching, chunked prefill, retraction, abort, stops, validation."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.engine.api import GenerateRequest, RequestError, SamplingParams
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, run, run_many, wait_idle


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def greedy(ids: list[int], n: int = 6, **extra: object) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]
    return GenerateRequest(tuple(ids), params)


def test_chunked_prefill_gives_the_same_tokens(make_engine: Callable[..., Engine]) -> None:
    ids = prompt(0, 200)
    whole = run(make_engine("--page-size", "4"), ids, logits=True, ignore_eos=True)
    chunked = run(
        make_engine("--page-size", "4", "--chunked-prefill-size", "7"),
        ids, logits=True, ignore_eos=True,
    )
    assert chunked.token_ids == whole.token_ids
    for a, b in zip(whole.logits, chunked.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_concurrent_requests_match_their_solo_runs_under_pool_pressure(
    make_engine: Callable[..., Engine],
) -> None:
    # 32 requests sharing a few prefixes, on a device pool too small for all of
    # them at once: admission waits for room, later ones hit the prefixes that
    # earlier ones left in the tree, and the tree evicts.
    flags = ("--page-size", "8", "--max-total-tokens", "1024", "--enable-hierarchical-cache")
    bases = [prompt(100 + i, 96) for i in range(4)]
    requests = [
        greedy(bases[i % 4] + prompt(200 + i, 8 + i), n=12 + i % 5) for i in range(32)
    ]
    solo_engine = make_engine(*flags)
    solo = [run(solo_engine, list(r.input_ids), ignore_eos=True,
                max_new_tokens=r.sampling.max_new_tokens).token_ids for r in requests]
    solo_engine.shutdown()

    engine = make_engine(*flags, "--chunked-prefill-size", "64")
    results = run_many(engine, requests)
    assert [r.token_ids for r in results] == solo
    assert all(r.last.finish_reason == "length" for r in results)
    assert sum(r.last.cached_tokens.total for r in results) > 0  # the shared prefixes hit
    assert engine.scheduler.counters.num_finished == 32
    # Each request's hit is counted once, however many steps it waited for room.
    assert engine.cache.stats.num_requests == 32
    counters = engine.scheduler.counters
    assert counters.num_cached_device_tokens == sum(r.last.cached_tokens.device for r in results)
    assert counters.num_cached_host_tokens == sum(r.last.cached_tokens.host for r in results)
    engine.check_integrity()


def test_decodes_outgrowing_the_pool_are_retracted_and_resume_correctly(
    make_engine: Callable[..., Engine],
) -> None:
    # Four requests whose prompts fit together but whose outputs do not: some
    # must be retracted mid-decode and resume (mostly from their cached KV).
    flags = ("--page-size", "4", "--max-total-tokens", "256")
    requests = [greedy(prompt(300 + i, 40), n=70) for i in range(4)]
    solo_engine = make_engine(*flags)
    solo = [run(solo_engine, list(r.input_ids), ignore_eos=True, max_new_tokens=70).token_ids
            for r in requests]
    solo_engine.shutdown()

    engine = make_engine(*flags)
    results = run_many(engine, requests)
    assert engine.scheduler.counters.num_retractions > 0
    assert [r.token_ids for r in results] == solo
    assert engine.cache.stats.num_requests == 4  # once each, not again on resuming
    engine.check_integrity()


def test_aborted_request_frees_everything(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--page-size", "4", "--enable-hierarchical-cache")
    pool = engine.cache.device_pool.allocator

    async def start_then_leave() -> int:
        stream = engine.generate(greedy(prompt(5, 64), n=500))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()  # what the server does when the client disconnects
        return seen

    assert asyncio.run(start_then_leave()) == 3
    wait_idle(engine)  # the aborted request is gone
    assert engine.scheduler.counters.num_aborted == 1
    engine.check_integrity()
    # Only the tree holds pages now, and all of them can be evicted.
    assert pool.num_used_pages == engine.cache.tree.num_evictable_device_pages



def test_a_caller_whose_event_loop_is_gone_costs_nobody_else_anything(
    make_engine: Callable[..., Engine],
) -> None:
    """The abort of a stream abandoned just before its loop closed meets a closed loop.

    The scheduler is held between steps until ``asyncio.run`` has returned, so the
    abort (and its final output) is handled only once the caller's loop is closed.
    Another client, on its own loop, must not notice.
    """
    engine = make_engine("--page-size", "4")
    release, other_started = threading.Event(), threading.Event()
    ids, other_ids = prompt(6, 64), prompt(7, 48)
    other: list[Run] = []

    async def other_client() -> Run:
        outputs = []
        async for output in engine.generate(greedy(other_ids, n=300)):
            outputs.append(output)
            other_started.set()
        return Run(outputs)

    worker = threading.Thread(target=lambda: other.append(asyncio.run(other_client())))
    worker.start()
    assert other_started.wait(10)

    async def start_then_leave() -> None:
        stream = engine.generate(greedy(ids, n=500))
        await anext(stream)
        engine.scheduler.call(lambda: release.wait(10))
        await stream.aclose()  # the abort queues behind the held call

    asyncio.run(start_then_leave())
    release.set()
    worker.join(60)
    assert not worker.is_alive()
    assert other[0].last.error is None
    assert other[0].last.finish_reason == "length"
    assert len(other[0].token_ids) == 300
    assert engine.scheduler.counters.num_aborted == 1
    # Still serving: a new request on a new loop is answered in full.
    again = run(engine, ids, ignore_eos=True)
    assert len(again.token_ids) == 8
    assert again.last.cached_tokens.total > 0  # the aborted request's KV was kept
    engine.check_integrity()


def test_stop_strings_tokens_and_lengths(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--page-size", "4")
    ids = prompt(7, 40)
    free = run(engine, ids, ignore_eos=True, max_new_tokens=24)
    assert free.last.finish_reason == "length"
    assert len(free.token_ids) == 24 == free.last.completion_tokens

    stop_token = free.token_ids[5]
    cut = run(engine, ids, ignore_eos=True, max_new_tokens=24, stop_token_ids=(stop_token,))
    assert cut.last.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]

    text = free.text
    if len(text) >= 6:  # a stop string from the middle of the free-running text
        stop = text[3:6]
        stopped = run(engine, ids, ignore_eos=True, max_new_tokens=24, stop=(stop,))
        assert stopped.last.finish_reason == "stop"
        assert stopped.text == text[: text.index(stop)]
        assert stop not in stopped.text


def test_seeded_sampling_is_reproducible(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--page-size", "4")
    ids = prompt(8, 30)
    a = run(engine, ids, temperature=1.0, seed=42, max_new_tokens=16, ignore_eos=True)
    b = run(engine, ids, temperature=1.0, seed=42, max_new_tokens=16, ignore_eos=True)
    c = run(engine, ids, temperature=1.0, seed=43, max_new_tokens=16, ignore_eos=True)
    g = run(engine, ids, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 16 draws over ~500 tokens: equal only by a bug
    assert a.token_ids != g.token_ids
    k1 = run(engine, ids, temperature=1.0, top_k=1, seed=1, max_new_tokens=16, ignore_eos=True)
    assert k1.token_ids == g.token_ids  # top_k=1 is greedy


@pytest.mark.parametrize(
    ("ids", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**6], SamplingParams(), "out of the vocabulary"),
        ([1, 2, -1], SamplingParams(), "out of the vocabulary"),
        ([1] * 100, SamplingParams(max_new_tokens=10**7), "context"),
        ([1, 2], SamplingParams(max_new_tokens=-1), "max_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=2, min_new_tokens=3), "min_new_tokens"),
        ([1, 2], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        ([1, 2], SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_requests_are_refused_before_queueing(
    make_engine: Callable[..., Engine], ids: list[int], params: SamplingParams, message: str
) -> None:
    engine = make_engine("--page-size", "4")
    with pytest.raises(RequestError, match=message):
        run_many(engine, [GenerateRequest(tuple(ids), params)])
    assert engine.scheduler.counters.num_requests == 0
    assert run(engine, [1, 2, 3]).last.finish_reason in ("length", "stop")


def test_without_prefix_cache_nothing_is_reused(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--page-size", "4", "--disable-radix-cache")
    ids = prompt(9, 50)
    first = run(engine, ids, ignore_eos=True)
    second = run(engine, ids, ignore_eos=True)
    assert second.last.cached_tokens.total == 0
    assert second.token_ids == first.token_ids
    engine.check_integrity()
    assert engine.cache.device_pool.allocator.num_used_pages == 0


def test_a_lone_request_short_of_pages_held_by_l3_backups_waits_instead_of_failing(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    """Write-back needs host pages to evict device pages; L3 backups in flight hold them.

    That shortage ends when the backups finish: a request that fits the empty pool
    waits for it (requeued) rather than being failed as too large.
    """
    extra = json.dumps({"path": str(tmp_path / "l3")})
    engine = make_engine(
        "--page-size", "4", "--max-total-tokens", "64", "--enable-hierarchical-cache",
        "--hicache-write-policy", "write_back", "--hicache-ratio", "2",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
    )
    storage = engine.cache.storage
    assert storage is not None
    gate = threading.Event()
    backend_set = storage.backend.set

    def held_set(*args: object) -> int:
        assert gate.wait(30)
        return backend_set(*args)  # type: ignore[arg-type]

    storage.backend.set = held_set  # type: ignore[method-assign]
    timer = threading.Timer(1.0, gate.set)
    try:
        answers = [run(engine, prompt(20 + i, 40), ignore_eos=True) for i in range(3)]
        timer.start()
        answers += [run(engine, prompt(20 + i, 40), ignore_eos=True) for i in range(3, 6)]
    finally:
        gate.set()
        if timer.is_alive():
            timer.join()
    storage.backend.set = backend_set  # type: ignore[method-assign]
    for answer in answers:
        assert answer.last.error is None, answer.last.error
        assert answer.last.finish_reason == "length" and len(answer.token_ids) == 8
    cold_engine = make_engine("--page-size", "4", "--disable-radix-cache")
    for i, answer in enumerate(answers):
        assert answer.token_ids == run(cold_engine, prompt(20 + i, 40), ignore_eos=True).token_ids
    engine.check_integrity()
