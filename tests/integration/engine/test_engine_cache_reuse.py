"""Reuse is sacred: a prompt answered from L1, L2 or L3 gives exactly what it gives cold.

Each case builds an engine over the tiny dummy model with L2 and the file L3,
answers one prompt cold, then again from each tier in turn (L1; L2 after
evicting L1; L3 after flushing L1 and L2), and compares greedy tokens and the
logits they came from. The cached runs compute the same suffix over the same
reused KV, so their logits are bit-identical to each other; against the cold
run (one long prefill) they agree to float rounding and pick the same tokens
(short of an exact tie at the dtype's precision; see ``assert_same``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect, run

PAGE = 16
PROMPT_LEN = 300  # past the prefetch threshold below, and not a whole number of pages


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def evict_device(engine: Engine) -> None:
    """Push every unlocked page out of L1 (its L2 copy stays)."""
    assert engine.evict_device_cache() > 0


def assert_same(cold: Run, cached: Run, tolerance: float = 1e-5) -> None:
    """Same greedy tokens, from logits equal within ``tolerance``.

    A token may differ only where the cold run's two best logits are within twice
    the tolerance of each other: a tie at this precision (bf16 on a GPU, where the
    long cold prefill and the short cached one use different kernels), which either
    run may break either way. The two answers diverge there, so comparing stops.
    """
    assert len(cached.logits) == len(cold.logits) == len(cold.token_ids)
    assert len(cached.token_ids) == len(cold.token_ids)
    for i, (a, b) in enumerate(zip(cold.logits, cached.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance)
        if cached.token_ids[i] != cold.token_ids[i]:
            best, second = a.float().topk(2).values.tolist()
            assert best - second <= 2 * tolerance, (
                f"token {i}: cached {cached.token_ids[i]} != cold {cold.token_ids[i]}, "
                f"though cold preferred it by {best - second:.3g}"
            )
            return


def l3_flags(path: Path, layout: str, io: str, *extra: str) -> tuple[str, ...]:
    config = {"path": str(path), "prefetch_threshold": 64}
    return (
        "--page-size", str(PAGE), "--max-total-tokens", "2048",
        "--enable-hierarchical-cache", "--hicache-mem-layout", layout, "--hicache-io-backend", io,
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config), *extra,
    )


def check_tiers_equal_cold(engine: Engine, tolerance: float = 1e-5) -> None:
    """Cold, then L1, L2 and L3 hits of one prompt: same tokens, same logits."""
    assert engine.cache.storage is not None, engine.cache.storage_error
    ids = prompt(1)
    reused = (PROMPT_LEN - 1) // PAGE * PAGE  # whole pages of all but the last prompt token

    cold = run(engine, ids, logits=True, ignore_eos=True)
    assert cold.last.cached_tokens.total == 0
    assert cold.last.finish_reason == "length"

    l1 = run(engine, ids, logits=True, ignore_eos=True)
    assert (l1.last.cached_tokens.device, l1.last.cached_tokens.host) == (reused, 0)
    assert_same(cold, l1, tolerance)

    evict_device(engine)
    l2 = run(engine, ids, logits=True, ignore_eos=True)
    assert (l2.last.cached_tokens.device, l2.last.cached_tokens.host) == (0, reused)
    assert l2.last.cached_tokens.storage == 0
    assert_same(cold, l2, tolerance)

    assert engine.flush_cache()
    l3 = run(engine, ids, logits=True, ignore_eos=True)
    assert l3.last.cached_tokens.storage == reused, l3.last.cached_tokens
    assert l3.last.cached_tokens.device == 0
    assert_same(cold, l3, tolerance)
    # The three cached runs computed the same suffix over the same KV: bit for bit.
    for other in (l2, l3):
        for a, b in zip(l1.logits, other.logits, strict=True):
            assert torch.equal(a, b)
    engine.check_integrity()


@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_l1_l2_l3_hits_equal_cold(
    make_engine: Callable[..., Engine], tmp_path: Path, layout: str, io: str
) -> None:
    check_tiers_equal_cold(make_engine(*l3_flags(tmp_path / "l3", layout, io)))


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_every_write_policy_reaches_l2_and_l3(
    make_engine: Callable[..., Engine], tmp_path: Path, policy: str
) -> None:
    flags = l3_flags(tmp_path / "l3", "page_first", "direct", "--hicache-write-policy", policy)
    check_tiers_equal_cold(make_engine(*flags))


def test_restarted_engine_hits_l3_pages_of_the_previous_one(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    flags = l3_flags(tmp_path / "l3", "layer_first", "direct")
    first = make_engine(*flags)
    ids = prompt(2)
    cold = run(first, ids, logits=True, ignore_eos=True)
    assert first.flush_cache()  # drains the L3 backups
    first.shutdown()

    second = make_engine(*flags)
    warm = run(second, ids, logits=True, ignore_eos=True)
    assert warm.last.cached_tokens.storage == (PROMPT_LEN - 1) // PAGE * PAGE
    assert_same(cold, warm)


def test_corrupted_l3_page_is_recomputed(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(*l3_flags(tmp_path / "l3", "page_first", "direct"))
    ids = prompt(3)
    cold = run(engine, ids, logits=True, ignore_eos=True)
    assert engine.flush_cache()
    pages = sorted((tmp_path / "l3").rglob("*.*m"), key=lambda p: p.stat().st_mtime)
    assert pages, "no L3 page files were written"
    for path in pages:  # flip one payload byte in every page: each one must be caught
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = run(engine, ids, logits=True, ignore_eos=True)
    assert again.last.cached_tokens.storage == 0
    assert_same(cold, again)
    status = engine.storage_status()
    assert sum(status["backend_stats"]["failures"].values()) >= 1


def test_cache_salts_never_share_kv_in_any_tier(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(*l3_flags(tmp_path / "l3", "page_first", "direct"))
    ids = prompt(3)
    reused = (PROMPT_LEN - 1) // PAGE * PAGE
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def salted(salt: str | None) -> Run:
        request = GenerateRequest(tuple(ids), params, extra_key=salt)
        return asyncio.run(collect(engine, request))

    first = salted("a")
    assert first.last.cached_tokens.total == 0
    # The same prompt under another salt, or none, shares nothing with it.
    assert salted("b").last.cached_tokens.total == 0
    assert salted(None).last.cached_tokens.total == 0
    assert salted("a").last.cached_tokens.device == reused
    assert engine.flush_cache()  # L1 and L2 forget; L3 keeps each salt's pages apart
    from_l3 = salted("b")
    assert from_l3.last.cached_tokens.storage == reused
    never_stored = salted("c")
    assert never_stored.last.cached_tokens.total == 0
    assert from_l3.token_ids == never_stored.token_ids == first.token_ids
    engine.check_integrity()
