"""Under tensor parallelism (2 ranks, gloo over loopback) a forced load-or-recompute split
gives the cold answer on every rank, and every rank takes the same choice.

One scenario, on the tiny preset (MHA) and on a tiny DeepSeek-V3 (MLA), in float32: a
prompt answered cold, its device pages evicted (L2 keeps them), the prompt again with
its host hit loaded up to a forced middle page (a host split); then L1 and L2 flushed
and the prompt once more while a throttled file store reads its pages back two per
call, the prefetch cut once a forced count has landed (an L3 split). The forced advisor
(``tests/forced_reuse.py``) is the same on both ranks and reads the landed count the
ranks agreed on, so the ranks must cut at the same point, take the same tokens from
each tier and end with the same tree.

The single-rank oracle matrix is ``tests/integration/engine/test_engine_reuse_splits.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import CacheConfig
from hicache.engine.api import GenerateRequest
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.deepseek_checkpoints import deepseek_variants, write_deepseek
from tests.hf_checkpoints import VOCAB as DEEPSEEK_VOCAB
from tests.ranks import run_ranks
from tests.tp_engine_ranks import Scenario, Step, greedy, prompt
from tests.tp_reuse_ranks import ForcedSplits, ForcedSplitsResult, run_forced_splits

TINY_VOCAB = 500  # below the tiny preset's vocabulary
PAGE_SIZE = 4
PROMPT_LEN = 61
REUSED = (PROMPT_LEN - 1) // PAGE_SIZE * PAGE_SIZE  # 15 pages held by the tiers
BOUNDARY = 7 * PAGE_SIZE  # the host split: 7 pages loaded, the other 8 computed
READ_BATCH_PAGES = 2
CUT_TOKENS = 2 * READ_BATCH_PAGES * PAGE_SIZE  # after the second read of eight


def _config(path: Path, model: ModelLoadConfig) -> EngineConfig:
    extra = {
        "backend": "file", "backend_extra": {"path": str(path)}, "read_latency_ms": 60,
    }
    storage = StorageConfig(
        backend="throttled", prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=4,
        prefetch_timeout_max=600.0, io_timeout_s=600.0, backend_extra=extra,
    )
    return EngineConfig(
        model=model,
        scheduling=SchedulingConfig(max_total_tokens=512),
        cache=CacheConfig(page_size=PAGE_SIZE, enable_hierarchical_cache=True),
        storage=storage,
        parallel=ParallelConfig(tp_size=2),
    )


def _steps(vocab: int) -> tuple[Step, ...]:
    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(input_ids=prompt(5, PROMPT_LEN, vocab), sampling=greedy(),
                               rid=rid)

    return (
        Step((request("cold"),), op_after="evict_device_cache"),
        Step((request("host-split"),), op_after="flush"),
        Step((request("l3-split"),)),
    )


@pytest.fixture(params=["mha", "mla"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelLoadConfig, int]:
    """The model's load config and a vocabulary its prompts stay below."""
    if request.param == "mha":
        return ModelLoadConfig(preset="tiny", device="cpu", dtype="float32"), TINY_VOCAB
    path = tmp_path_factory.mktemp("deepseek-v3")
    write_deepseek(deepseek_variants()["v3"], path)
    return ModelLoadConfig(model_path=str(path), device="cpu", dtype="float32"), DEEPSEEK_VOCAB


def test_tp2_forced_splits_equal_cold_and_ranks_choose_alike(
    tmp_path: Path, model: tuple[ModelLoadConfig, int]
) -> None:
    load, vocab = model
    case = ForcedSplits(
        Scenario(_config(tmp_path / "l3", load), _steps(vocab)), BOUNDARY,
        frozenset({"host-split"}), CUT_TOKENS, READ_BATCH_PAGES,
    )
    results: list[ForcedSplitsResult] = run_ranks(run_forced_splits, 2, case)
    leader, follower = results
    # Every rank chose alike: the same cut, the same reports (decision, cached and loaded
    # tokens), the same tokens from L3, the same tree.
    assert follower.reports == leader.reports
    assert follower.cut_landed == leader.cut_landed
    ranks = leader.ranks
    assert follower.ranks.storage_tokens == ranks.storage_tokens
    assert follower.ranks.num_ticks == ranks.num_ticks
    assert follower.ranks.tree_device_pages == ranks.tree_device_pages
    assert follower.ranks.tree_host_pages == ranks.tree_host_pages
    for result in results:  # the cold answer on every rank
        tokens = result.ranks.tokens
        assert tokens["host-split"] == tokens["l3-split"] == tokens["cold"]

    assert ranks.cached["host-split"] == (0, BOUNDARY)
    assert leader.reports["host-split"] == ("split", BOUNDARY, BOUNDARY)
    # The L3 prefetch was cut mid-way, and exactly what had landed then was used.
    landed = leader.cut_landed
    assert landed is not None and CUT_TOKENS <= landed < REUSED, landed
    assert ranks.storage_tokens["l3-split"] == landed
    assert ranks.cached["l3-split"] == (0, 0)  # (device, host): all it loaded came from L3
    assert leader.reports["l3-split"] == ("split", landed, landed)
