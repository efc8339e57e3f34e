"""Any load-or-recompute split gives exactly the cold answer (issue 31's oracle).

The engine chooses per request where its cached prefix ends: the pages before that
boundary are loaded from the host tier (L2) or L3, the prompt after it is computed
again. Here the boundary is forced (``tests/forced_reuse.py``) instead of priced, so
every kind of choice runs whatever the live costs say:

- host splits: a prompt answered cold, its device pages evicted (L2 keeps them), then
  the same prompt from a forced boundary: the device end (pure recompute), one page, the
  middle, all but one page, everything (pure load);
- L3 cuts: L1 and L2 flushed (L3 keeps the pages), the same prompt while a throttled
  store reads its pages back one per call, the prefetch cut once a forced number of
  tokens has landed: before any (recompute), mid-way (a split), never (load); and cut
  mid-way with only part of what landed loaded (the rest computed again over it);
- a split past a device hit (the first pages on the device, the next on the host), and a
  split whose recomputed tail is prefilled beside another request's decode rows.

Each answer's greedy tokens and the logits they came from equal the cold run's
(``assert_same``: float32 on the CPU, within 1e-5), and the request's ``ReuseReport``
names the choice (``split`` for an interior boundary, ``load`` and ``recompute`` at
the ends) with the tokens it cached and loaded. Every page size the host tier takes
(1, 16, 64) runs with every host layout for the tiny MHA model; the MLA model (a tiny
DeepSeek-V2) runs fewer points. Tensor parallelism is in
``tests/e2e/engine/test_tp_reuse_splits.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import hicache.storage.controller as storage_controller
from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.storage.base import MAX_BATCH_PAGES
from tests.deepseek_checkpoints import deepseek_variants, write_deepseek
from tests.engine_helpers import Run, run
from tests.forced_reuse import force_reuse
from tests.hf_checkpoints import Checkpoint
from tests.integration.engine.test_engine_cache_reuse import assert_same, prompt

PROMPT_LEN = 300  # not a whole number of pages at any page size here
# Pages one throttled L3 read returns in the L3 cases: a 300-token prompt's pages land
# over several reads, so a cut can fall between them.
READ_BATCH_PAGES = 1
# Per read: a read lands long after the scheduler's next poll (every few ms), and the
# reads left after a cut take longer than a busy machine may delay that poll.
READ_LATENCY_MS = 60


def reused_tokens(page: int) -> int:
    """Whole pages of all but the last prompt token: what the tiers hold of the prompt."""
    return (PROMPT_LEN - 1) // page * page


def host_flags(page: int, layout: str, *extra: str) -> tuple[str, ...]:
    return (
        "--page-size", str(page), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        "--hicache-mem-layout", layout, "--hicache-io-backend", "direct", *extra,
    )


def l3_flags(
    page: int, layout: str, path: Path, read_latency_ms: float = READ_LATENCY_MS
) -> tuple[str, ...]:
    # The file store behind a throttle: each read waits its latency, so the pages of one
    # prefetch land read by read. Patient deadlines: only the forced cut ends a wait.
    config = {
        "backend": "file", "backend_extra": {"path": str(path)},
        "read_latency_ms": read_latency_ms, "prefetch_threshold": 1, "io_timeout_s": 600.0,
        "prefetch_timeout_max": 600.0,
    }
    return host_flags(
        page, layout, "--hicache-storage-backend", "throttled",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )


def boundaries(page: int) -> list[int]:
    """The device end, one page, the middle, all but one page, all (page multiples)."""
    end = reused_tokens(page)
    middle = end // page // 2 * page
    return sorted({0, page, middle, end - page, end})


def expected_decision(cached: int, device: int, available: int) -> str:
    if cached >= available:
        return "load"
    return "recompute" if cached <= device else "split"


def run_cold(engine: Engine, ids: list[int]) -> Run:
    cold = run(engine, ids, logits=True, ignore_eos=True)
    assert cold.last.cached_tokens.total == 0
    return cold


def check_host_splits(engine: Engine, page: int, points: list[int]) -> None:
    """Cold, then from each forced boundary over the host tier: the cold answer each time."""
    ids = prompt(11, PROMPT_LEN)
    cold = run_cold(engine, ids)
    available = reused_tokens(page)
    threshold = engine.cache.config.load_back_threshold_tokens
    for boundary in points:
        assert engine.evict_device_cache() > 0
        forced = force_reuse(engine, boundary=boundary)
        warm = run(engine, ids, logits=True, ignore_eos=True)
        # A host hit shorter than the load-back threshold is not loaded: computed again.
        cached = boundary if boundary >= threshold else 0
        assert (warm.last.cached_tokens.device, warm.last.cached_tokens.host) == (0, cached)
        report = warm.last.reuse
        assert report is not None
        assert report.decision == forced.reports[warm.last.rid].decision
        assert report.decision == expected_decision(cached, 0, available), (boundary, report)
        assert (report.cached_tokens, report.loaded_tokens) == (cached, cached)
        assert report.recomputed_tokens == available - cached
        assert_same(cold, warm)
    engine.check_integrity()


def check_l3_cuts(engine: Engine, page: int, cuts: list[int | None]) -> None:
    """Cold, then from L3 after a flush, the prefetch cut at each forced landed count."""
    assert engine.cache.storage is not None, engine.cache.storage_error
    ids = prompt(12, PROMPT_LEN)
    cold = run_cold(engine, ids)
    available = reused_tokens(page)
    for cut in cuts:
        assert engine.flush_cache()  # L3 keeps the pages; L1 and L2 forget them
        forced = force_reuse(engine, cut_tokens=cut)
        warm = run(engine, ids, logits=True, ignore_eos=True)
        landed = available if cut is None else forced.cut_landed
        assert landed is not None, f"the prefetch was never cut at {cut}"
        if cut is not None:
            # Cut at the scheduler's first poll past the forced count (it polls every few
            # ms, a read takes READ_LATENCY_MS): before the last read landed.
            assert cut <= landed < available, (cut, landed)
        # Exactly what had landed when cut was used; the rest was computed.
        assert warm.last.cached_tokens.storage == landed, (cut, warm.last.cached_tokens)
        assert warm.last.cached_tokens.device == 0
        report = warm.last.reuse
        assert report is not None
        assert report.decision == expected_decision(landed, 0, available), (cut, report)
        assert (report.cached_tokens, report.loaded_tokens) == (landed, landed)
        assert_same(cold, warm)
    engine.check_integrity()


# ---------------------------------------------------------------- MHA (tiny preset)

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_host_split_at_every_kind_of_boundary_equals_cold(
    make_engine: Callable[..., Engine], page: int, layout: str
) -> None:
    points = boundaries(page)
    if page == 1:
        points.append(10)  # one page is below the load-back threshold: the first loaded
    check_host_splits(make_engine(*host_flags(page, layout)), page, sorted(set(points)))


def _greedy(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def run_one(engine: Engine, request: GenerateRequest) -> Run:
    """One request with a rid of its own; its outputs and the logits of its tokens."""
    return run_batch(engine, request, None)[0][request.rid]


def run_batch(
    engine: Engine, first: GenerateRequest, joining: GenerateRequest | None
) -> tuple[dict[str, Run], list[str]]:
    """``first``, then ``joining`` once ``first`` has its first token (so that it joins a
    batch that decodes): each request's outputs and the logits of its tokens, by rid,
    and the rid of every token sampled, in order."""
    seen: dict[str, list[torch.Tensor]] = {first.rid: []}
    if joining is not None:
        seen[joining.rid] = []
    order: list[str] = []

    def observe(rid: str, row: torch.Tensor) -> None:
        seen[rid].append(row)
        order.append(rid)

    async def both() -> dict[str, Run]:
        started = asyncio.Event()

        async def collect(request: GenerateRequest) -> Run:
            outputs: list[GenerateOutput] = []
            async for out in engine.generate(request):
                outputs.append(out)
                if out.token_ids:
                    started.set()
            return Run(outputs)

        leading = asyncio.create_task(collect(first))
        runs: dict[str, Run] = {}
        if joining is not None:
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({leading, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            runs[joining.rid] = await collect(joining)
        runs[first.rid] = await leading
        for rid, result in runs.items():
            result.logits = seen[rid]
        return runs

    engine.scheduler.postprocess.logits_observer = observe
    try:
        return asyncio.run(both()), order
    finally:
        engine.scheduler.postprocess.logits_observer = None


def test_split_joining_a_decoding_batch_equals_cold(make_engine: Callable[..., Engine]) -> None:
    """The split's recomputed tail is prefilled beside another request's decode rows: both
    answers are their cold ones (the other loaded whole from the host tier)."""
    page = 16
    engine = make_engine(*host_flags(page, "page_first"))
    ids, other_ids = prompt(14, PROMPT_LEN), prompt(15, 40)
    cold, other_cold = run_cold(engine, ids), run(engine, other_ids, logits=True,
                                                  ignore_eos=True, max_new_tokens=48)
    assert engine.evict_device_cache() > 0
    boundary = reused_tokens(page) // page // 2 * page
    force_reuse(engine, boundary=boundary, boundary_rids=frozenset({"split"}))
    runs, order = run_batch(
        engine, GenerateRequest(tuple(other_ids), _greedy(48), rid="other"),
        GenerateRequest(tuple(ids), _greedy(), rid="split"),
    )
    warm, other = runs["split"], runs["other"]
    # The split's first token came while the other request was still decoding.
    assert order.index("split") < len(order) - 1 - order[::-1].index("other"), order
    assert warm.last.reuse is not None and warm.last.reuse.decision == "split"
    assert warm.last.cached_tokens.host == boundary
    assert other.last.cached_tokens.host == (len(other_ids) - 1) // page * page
    assert_same(cold, warm)
    assert_same(other_cold, other)
    engine.check_integrity()


def test_split_past_a_device_hit_equals_cold(make_engine: Callable[..., Engine]) -> None:
    """The first pages on the device (a shorter prompt loaded them), the next on the host:
    a boundary at the device end (recompute), inside the host part (split) or at its end
    (load) gives the cold answer."""
    page = 16
    engine = make_engine(*host_flags(page, "layer_first"))
    ids = prompt(16, PROMPT_LEN)
    cold = run_cold(engine, ids)
    shorter = 160  # loads its 144 host tokens and computes the rest: 160 on the device
    end = reused_tokens(page)
    for boundary in (shorter, shorter + 2 * page, end):
        assert engine.evict_device_cache() > 0
        force_reuse(engine, boundary=boundary, boundary_rids=frozenset({"split"}))
        prefix = GenerateRequest(tuple(ids[:shorter]), _greedy(), rid=f"prefix-{boundary}")
        assert run_one(engine, prefix).last.cached_tokens.host == 144
        warm = run_one(engine, GenerateRequest(tuple(ids), _greedy(), rid="split"))
        assert (warm.last.cached_tokens.device, warm.last.cached_tokens.host) == (
            shorter, boundary - shorter
        )
        report = warm.last.reuse
        assert report is not None
        assert report.decision == expected_decision(boundary, shorter, end), (boundary, report)
        assert (report.cached_tokens, report.loaded_tokens) == (boundary, boundary - shorter)
        assert_same(cold, warm)
    engine.check_integrity()


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """L3 reads of one page each, so a prefetch lands in steps a cut can fall between."""
    monkeypatch.setattr(storage_controller, "MAX_BATCH_PAGES", READ_BATCH_PAGES)


@pytest.mark.usefixtures("small_reads")
@pytest.mark.parametrize(("page", "layout"), [(16, "page_first_direct"), (64, "layer_first")])
def test_l3_prefetch_cut_mid_way_equals_cold(
    make_engine: Callable[..., Engine], tmp_path: Path, page: int, layout: str
) -> None:
    middle = READ_BATCH_PAGES * page  # after the first read
    check_l3_cuts(make_engine(*l3_flags(page, layout, tmp_path / "l3")), page, [0, middle, None])


@pytest.mark.usefixtures("small_reads")
def test_l3_landed_pages_past_the_boundary_are_computed_again_equal_cold(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """A prefetch cut mid-way, then only the first of its landed pages loaded: the landed
    pages past the boundary sit in the tree on the host alone, and the recomputed tail
    is adopted over them; the answer, and the next one (from L1), are the cold one."""
    page = 16
    engine = make_engine(*l3_flags(page, "layer_first", tmp_path / "l3"))
    ids = prompt(13, PROMPT_LEN)
    cold = run_cold(engine, ids)
    assert engine.flush_cache()
    cut, boundary = 2 * READ_BATCH_PAGES * page, READ_BATCH_PAGES * page
    forced = force_reuse(engine, boundary=boundary, cut_tokens=cut)
    warm = run(engine, ids, logits=True, ignore_eos=True)
    landed = forced.cut_landed
    assert landed is not None and boundary < cut <= landed < reused_tokens(page), landed
    assert (warm.last.cached_tokens.device, warm.last.cached_tokens.storage) == (0, boundary)
    report = warm.last.reuse
    assert report is not None and report.decision == "split", report
    assert (report.cached_tokens, report.loaded_tokens) == (boundary, boundary)
    assert report.recomputed_tokens == reused_tokens(page) - boundary
    assert_same(cold, warm)
    engine.check_integrity()
    # The tree holds the whole prompt on the device now: a plain L1 hit, still cold's answer.
    again = run(engine, ids, logits=True, ignore_eos=True)
    assert again.last.cached_tokens.device == reused_tokens(page)
    assert_same(cold, again)
    engine.check_integrity()


def test_l3_cut_mid_way_at_page_size_one_equals_cold(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    # 299 one-token pages are three reads of the controller's own batch (128 pages); the
    # cut after the first leaves two, each slower here.
    engine = make_engine(*l3_flags(1, "page_first", tmp_path / "l3", read_latency_ms=200))
    check_l3_cuts(engine, 1, [MAX_BATCH_PAGES])


# ---------------------------------------------------------------- MLA (tiny DeepSeek-V2)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    config = deepseek_variants()["v2-lite"]
    config.max_position_embeddings = 1024  # room for the 300-token prompts
    return write_deepseek(config, tmp_path_factory.mktemp("v2-lite"))


def _mla(checkpoint: Checkpoint) -> tuple[str, ...]:
    return ("--model-path", str(checkpoint.path), "--dtype", "float32")


@pytest.mark.parametrize(("page", "layout"), [(16, "layer_first"), (64, "page_first_direct")])
def test_mla_host_split_equals_cold(
    make_engine: Callable[..., Engine], deepseek: Checkpoint, page: int, layout: str
) -> None:
    end = reused_tokens(page)
    engine = make_engine(*_mla(deepseek), *host_flags(page, layout))
    check_host_splits(engine, page, [0, page, end // page // 2 * page, end])


@pytest.mark.usefixtures("small_reads")
def test_mla_l3_prefetch_cut_mid_way_equals_cold(
    make_engine: Callable[..., Engine], deepseek: Checkpoint, tmp_path: Path
) -> None:
    page = 16
    engine = make_engine(*_mla(deepseek), *l3_flags(page, "page_first", tmp_path / "l3"))
    check_l3_cuts(engine, page, [READ_BATCH_PAGES * page])
