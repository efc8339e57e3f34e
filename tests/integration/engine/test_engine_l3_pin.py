"""An L3 pin on a real engine and a real file store (tiny model, CPU): the pinned prompt's
pages outlive a stream of other prompts that pushes the store far past its size cap
(the unpinned ones written before it are evicted), and after L1 and L2 are emptied the
pinned prompt is answered from L3 exactly as it was cold; an unpin lets them go again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hicache.engine.api import Hint, HintKind, HintOutcomeKind
from hicache.engine.engine import Engine
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.file.ledger import LEDGER_FILE
from tests.engine_helpers import run
from tests.integration.engine.test_engine_cache_reuse import assert_same
from tests.integration.engine.test_engine_hints import (
    PAGE,
    REUSED,
    SETTLE_S,
    prompt,
    with_file_l3,
)
from tests.waiting import wait_until

PAGES = REUSED // PAGE
CAP_PAGES = 2 * PAGES + PAGES // 2  # room for two and a half prompts


def store_bytes(root: Path) -> int:
    return sum(
        p.stat().st_size for p in root.rglob("*")
        if p.is_file() and "pins" not in p.parts and p.name != LEDGER_FILE
    )


def pin_markers(root: Path) -> int:
    pins = root / "pins"
    return sum(1 for p in pins.rglob("*") if p.is_file()) if pins.exists() else 0


def test_an_l3_pin_outlives_eviction_past_the_cap_and_answers_as_cold(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    root = tmp_path / "l3"
    engine = make_engine(*with_file_l3(root))
    storage = engine.cache.storage
    assert storage is not None
    backend = storage.backend
    assert isinstance(backend, FileBackend)

    early, pinned = prompt(1), prompt(2)
    cold_early = run(engine, early, logits=True, ignore_eos=True)
    assert engine.flush_cache()  # waits for the L3 writes of what it forgets
    page_bytes = store_bytes(root) // PAGES
    assert page_bytes > 0
    cold = run(engine, pinned, logits=True, ignore_eos=True)

    [pin] = engine.apply_hints([Hint(HintKind.PIN, tuple(pinned), tier="l3", tenant="t")])
    assert pin.outcome in (HintOutcomeKind.ACCEPTED, HintOutcomeKind.DEFERRED), pin
    assert pin.tokens == REUSED
    assert wait_until(lambda: pin_markers(root) == PAGES, SETTLE_S)

    # From now on the store keeps two and a half prompts; six more pass through it.
    backend.max_bytes = CAP_PAGES * page_bytes
    for seed in range(10, 16):
        run(engine, prompt(seed), max_new_tokens=1)
    assert engine.flush_cache()
    assert store_bytes(root) <= CAP_PAGES * page_bytes

    again = run(engine, pinned, logits=True, ignore_eos=True)
    assert again.last.cached_tokens.storage == REUSED, again.last.cached_tokens
    assert again.token_ids == cold.token_ids
    assert_same(cold, again)
    # The prompt written before the pin, unpinned, was evicted on the way.
    later = run(engine, early, logits=True, ignore_eos=True)
    assert later.last.cached_tokens.storage < REUSED
    assert later.token_ids == cold_early.token_ids

    [unpin] = engine.apply_hints([Hint(HintKind.UNPIN, tuple(pinned), tenant="t")])
    assert unpin.outcome is HintOutcomeKind.ACCEPTED, unpin
    assert wait_until(lambda: pin_markers(root) == 0, SETTLE_S)
    engine.check_integrity()
