"""What the engine tests over a real L3 share across backends: the engine flags, and the
three phases of "the engine with this L3 answers as a cold run" (hit after a flush, recomputed
while the store is down, stored and hit again once it is back).

Every phase compares greedy tokens with a cold run's, so whatever L3 does, the output
must not change; only where the pages come from does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from hicache.engine.engine import Engine
from tests.engine_helpers import run
from tests.integration.engine.test_engine_cache_reuse import PAGE, PROMPT_LEN, prompt
from tests.waiting import wait_until

# Tokens of a prompt that L3 can give back: whole pages, the last token computed anyway.
REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
ENGINE_FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "2048",
                "--enable-hierarchical-cache")
# A breaker that opens after two failures and probes again soon: outages stay short.
FAST_BREAKER = {"breaker_failures": 2, "breaker_backoff_base": 0.2, "breaker_backoff_max": 0.2}
# A request recomputed while the store is down must not wait on it. What waiting would cost
# is made far longer than DOWN_S: the call deadline and the prefetch wait here, and the
# backends' own timeouts (a minute, set by each module; Mooncake's library retries a dead
# master for over a minute). A busy machine stays far under the bound, a wait on the store
# is far over it.
PATIENT_WAITS = {"io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
DOWN_S = 20.0
# Until a prompt is hit in L3 again after the store came back: a guard against a store
# that is never used again, not a bound on how soon.
RECOVERY_S = 60.0


def l3_engine_flags(backend: str, extra: dict[str, Any]) -> tuple[str, ...]:
    """Engine flags for ``backend`` as L3 (``extra`` its config, over PATIENT_WAITS), waiting
    for whole prefetches."""
    return (
        *ENGINE_FLAGS, "--hicache-storage-backend", backend,
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config",
        json.dumps({**PATIENT_WAITS, **extra, "prefetch_threshold": 64}),
    )


def assert_hit_after_flush(engine: Engine, ids: list[int], cold_tokens: list[int]) -> None:
    """Flush L1 and L2 and run ``ids`` again: L3 gives REUSED tokens back, the output is cold's."""
    assert engine.flush_cache()  # L1 and L2 forget it; L3 keeps it
    warm = run(engine, ids, ignore_eos=True)
    assert warm.last.cached_tokens.storage == REUSED
    assert warm.token_ids == cold_tokens


def assert_recomputed_while_down(
    engine: Engine, ids: list[int], cold_tokens: list[int], max_s: float = DOWN_S
) -> None:
    """With the store down, ``ids`` is recomputed within ``max_s``, not waiting on the store."""
    for _ in range(3):  # each flush sends the request to L3, which cannot answer
        assert engine.flush_cache()
        began = time.monotonic()
        down = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < max_s  # recomputed, not waiting on the dead store
        assert down.last.finish_reason == "length"
        assert down.last.cached_tokens.total == 0
        assert down.token_ids == cold_tokens


def assert_stored_and_hit_again(engine: Engine, recovery_s: float = RECOVERY_S) -> None:
    """After the store came back (empty), a new prompt is stored again, then hit within
    ``recovery_s``."""
    other = prompt(12)
    other_cold = run(engine, other, ignore_eos=True)
    wait_for_hit(engine, other, other_cold.token_ids, recovery_s)


def wait_for_hit(
    engine: Engine, ids: list[int], cold_tokens: list[int], timeout_s: float,
    reused_tokens: int = REUSED, poll_s: float = 0.1,
) -> None:
    """Flush and run ``ids`` until L3 gives ``reused_tokens`` back (within ``timeout_s``),
    e.g. while a breaker's backoff runs out; every run's output is cold's."""

    def hit() -> bool:
        assert engine.flush_cache()
        back = run(engine, ids, ignore_eos=True)
        assert back.token_ids == cold_tokens
        return back.last.cached_tokens.storage == reused_tokens

    assert wait_until(hit, timeout_s, poll_s), engine.storage_status()
