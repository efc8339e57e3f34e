"""The aibrix L3 under tensor parallelism (2 ranks, gloo over loopback): each rank is a
process with its own KV shard and opens its own RocksDB under ``path``, and a prefix read
back from L3 after a flush is the single-rank engine's (see tests/e2e/engine/
test_replication_l3.py for the file backend).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hicache.distributed.group import SINGLE_RANK
from hicache.storage.config import StorageConfig
from tests.dev_dependency import require_dev_dependency
from tests.e2e.engine.test_replication_l3 import FROM_L3, STEPS, _assert_ranks_alike, _config
from tests.ranks import run_ranks
from tests.tp_engine_ranks import Scenario, run_scenario

require_dev_dependency("aibrix_kvcache", "pip install 'hicache[aibrix]' (see scripts/bootstrap.sh)")


def _aibrix_scenario(path: Path, tp_size: int) -> Scenario:
    config = _config(path, tp_size)
    storage = dataclasses.replace(
        config.storage, backend="aibrix", backend_extra={
            "path": str(path), "l1_capacity": "8MiB", "timeout_per_token_ms": 1000
        }
    )
    assert isinstance(storage, StorageConfig)
    return Scenario(dataclasses.replace(config, storage=storage), STEPS)


def test_tp2_over_aibrix_reads_back_from_l3_like_one_rank(tmp_path: Path) -> None:
    alone = run_scenario(SINGLE_RANK, _aibrix_scenario(tmp_path / "alone", 1))
    assert all(alone.storage_tokens[rid] > 0 for rid in FROM_L3)  # L3 served them alone
    path = tmp_path / "tp2"
    leader, follower = run_ranks(run_scenario, 2, _aibrix_scenario(path, 2))
    _assert_ranks_alike(leader, follower)
    assert leader.tokens == alone.tokens
    assert leader.storage_tokens == alone.storage_tokens
    # Each rank opened its own RocksDB directory.
    assert sorted(p.name for p in path.iterdir()) == ["tp2-rank0", "tp2-rank1"]
