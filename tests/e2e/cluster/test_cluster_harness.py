"""The cluster harness itself: real ``hicache serve`` children on loopback, one shared L3.

Three tiny-model workers share a file L3: all answer, a prompt one of them
computed is read back from L3 by another, and leaving the block ends every
process. A part that fails to start takes the rest down with it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from hicache.bench.cluster import (
    Cluster,
    ClusterConfig,
    ClusterError,
    L3Kind,
    RouterConfig,
    serve_supports_kv_events,
    wait_for,
)
from hicache.testing.server_process import ServerStartError
from tests.dev_dependency import require_dev_dependency

# Tiny dummy model on CPU, a device pool of 1024 tokens in 16-token pages; L3 reads
# wait for the prefetch so that a cross-worker hit shows every time.
TINY_WORKER = (
    "--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu", "--page-size", "16",
    "--num-threads", "1", "--hicache-storage-prefetch-policy", "wait_complete",
)
L3_EXTRA = {"prefetch_threshold": 16}
# Starting the cluster, a request, an L3 write: guards against a hang, far above what a
# machine busy with other work needs.
TIMEOUT_S = 180.0


def _group_gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def _generate(url: str, ids: list[int]) -> dict[str, object]:
    reply = httpx.post(f"{url}/generate", timeout=TIMEOUT_S, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
    })
    assert reply.status_code == 200, reply.text
    meta: dict[str, object] = reply.json()["meta_info"]
    return meta


def test_three_workers_share_one_file_l3_and_stop_cleanly(tmp_path: Path) -> None:
    config = ClusterConfig(
        tmp_path, num_workers=3, worker_args=TINY_WORKER, max_total_tokens=1024,
        hicache_ratio=2.0, l3=L3Kind.FILE, l3_extra=L3_EXTRA,
        kv_events=serve_supports_kv_events(), router=None, startup_timeout_s=TIMEOUT_S,
    )
    with Cluster(config) as cluster:
        groups = cluster.process_groups()
        assert len(groups) == 3 and len(set(cluster.worker_urls())) == 3
        assert cluster.all_healthy()
        if config.kv_events:  # each worker publishes on ports of its own
            endpoints = [w.events.endpoint for w in cluster.workers if w.events]
            assert len(set(endpoints)) == 3
        # 6 full pages computed on worker 0 ...
        prompt = [(7 * i) % 250 + 1 for i in range(96)]
        first = _generate(cluster.workers[0].url, prompt)
        assert first["cached_tokens"] == 0
        l3 = cluster.l3_path
        assert l3 is not None
        # ... are written through to the shared directory ...
        assert wait_for(lambda: sum(1 for p in l3.rglob("*.*m") if p.is_file()) >= 5, TIMEOUT_S)
        # ... and worker 1, which never saw the prompt, reads them from L3.
        second = _generate(cluster.workers[1].url, prompt)
        details = second["cached_tokens_details"]
        assert isinstance(details, dict) and details.get("storage", 0) >= 16 * 5, second
        with pytest.raises(ClusterError, match="no router"):
            _ = cluster.url
    for worker in cluster.workers:
        assert not worker.running
        assert worker.log_path.is_file() and worker.log_path.stat().st_size > 0
    assert all(_group_gone(g) for g in groups), "a worker's process outlived the cluster"


def test_a_router_that_fails_to_start_takes_the_workers_down(tmp_path: Path) -> None:
    # A stand-in router that exits at once: the worker was up, and must go too.
    quitter = RouterConfig(program=(sys.executable, "-c", "import sys; sys.exit(3)"))
    config = ClusterConfig(
        tmp_path, num_workers=1, worker_args=TINY_WORKER, max_total_tokens=1024,
        l3=L3Kind.NONE, kv_events=False, router=quitter, startup_timeout_s=TIMEOUT_S,
    )
    cluster = Cluster(config)
    with pytest.raises(ServerStartError, match="the router exited with status 3"):
        cluster.start()
    assert len(cluster.workers) == 1
    assert all(not w.running for w in cluster.workers)
    assert all(_group_gone(g) for g in cluster.process_groups())
    assert "--worker-urls" in " ".join(cluster.router.command if cluster.router else [])


def test_bad_sizes_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="at least one worker"):
        ClusterConfig(tmp_path, num_workers=0)
    with pytest.raises(ClusterError, match="hicache_ratio must be > 1"):
        ClusterConfig(tmp_path, hicache_ratio=1.0)
    router = RouterConfig(args=("--shared-cache-type", "hicache", "{master_address}"))
    cluster = Cluster(ClusterConfig(tmp_path / "run", l3=L3Kind.FILE, kv_events=False,
                                    router=router))
    with pytest.raises(ClusterError, match="names the Mooncake master"):
        cluster.router_args(router)
    assert not (tmp_path / "run").exists()


def test_a_master_log_the_caller_chose_outlives_the_master(tmp_path: Path) -> None:
    require_dev_dependency("mooncake.store", "pip install 'hicache[mooncake]'")
    from hicache.testing.mooncake_master import start_master

    with start_master(log_path=tmp_path / "runs" / "master.log") as kept:
        assert kept.running
    with start_master() as temporary:
        assert temporary.log_path.is_file()
    assert (tmp_path / "runs" / "master.log").stat().st_size > 0
    assert not temporary.log_path.exists()  # a temporary log goes with its master
