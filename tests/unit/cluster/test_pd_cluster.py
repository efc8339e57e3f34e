"""A disaggregated cluster's composition (no process started): which worker runs which
mode with which flags, and the router command that pairs them; and ``hicache bench pd``'s
setups and report table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hicache.bench import pd_bench, router_bench
from hicache.bench.cluster import Cluster, ClusterConfig, ClusterError, RouterConfig
from hicache.bench.report import GroupSummary, RunSummary, Stats
from hicache.cli import build_parser


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_the_last_workers_decode_and_the_router_pairs_them(tmp_path: Path) -> None:
    config = ClusterConfig(tmp_path, num_workers=3, pd_decode_workers=1,
                           pd_decode_offload=True, kv_events=False)
    cluster = Cluster(config)
    cluster.workers = [cluster._make_worker(i, ["--hicache-storage-backend", "none"])
                       for i in range(3)]
    modes = [flag(w.server.command, "--disaggregation-mode") for w in cluster.workers]
    assert modes == ["prefill", "prefill", "decode"]
    ports = [w.bootstrap_port for w in cluster.workers]
    assert ports[2] is None and ports[0] != ports[1]
    for worker in cluster.workers[:2]:
        assert flag(worker.server.command, "--disaggregation-bootstrap-port") == str(
            worker.bootstrap_port)
        assert "--disaggregation-decode-enable-offload-kvcache" not in worker.server.command
    decode = cluster.workers[2].server.command
    assert "--disaggregation-decode-enable-offload-kvcache" in decode
    assert flag(decode, "--disaggregation-transfer-backend") == "mooncake"
    a, b, d = cluster.workers
    assert cluster.router_args(RouterConfig("cache_aware", ("--overlap-weight", "2"))) == [
        "--pd-disaggregation", "--prefill", a.url, str(a.bootstrap_port),
        "--prefill", b.url, str(b.bootstrap_port), "--decode", d.url,
        "--policy", "cache_aware", "--overlap-weight", "2"]
    # The router command parses into the pairs it names.
    args = build_parser().parse_args(["router", *cluster.router_args(RouterConfig())])
    assert [g[0] for g in args.prefill] == [a.url, b.url] and args.decode == [[d.url]]


def test_an_ordinary_cluster_has_no_disaggregation_flags(tmp_path: Path) -> None:
    cluster = Cluster(ClusterConfig(tmp_path, num_workers=2, kv_events=False))
    cluster.workers = [cluster._make_worker(i, []) for i in range(2)]
    assert all("--disaggregation-mode" not in w.server.command for w in cluster.workers)
    assert cluster.router_args(RouterConfig())[0] == "--worker-urls"


@pytest.mark.parametrize("decode", [2, 5])
def test_a_pd_cluster_needs_both_roles(tmp_path: Path, decode: int) -> None:
    with pytest.raises(ClusterError, match="at least one prefill and one decode"):
        ClusterConfig(tmp_path, num_workers=2, pd_decode_workers=decode)


def bench_args(*argv: str) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(["bench", "pd", *argv])
    router_bench.resolve_sizes(args)
    return args


def test_bench_pd_setups(tmp_path: Path) -> None:
    args = bench_args("--out-dir", str(tmp_path), "--smoke", "--pd-decode-offload")
    single = pd_bench.cluster_config(args, "single", tmp_path / "s")
    pd = pd_bench.cluster_config(args, "pd", tmp_path / "p")
    assert (single.num_workers, single.router, single.pd_decode_workers) == (1, None, 0)
    assert (pd.num_workers, pd.pd_decode_workers, pd.pd_decode_offload) == (2, 1, True)
    assert pd.router is not None and pd.router.policy == "cache_aware"
    assert single.worker_args == pd.worker_args and "--model-preset" in pd.worker_args
    assert single.max_total_tokens == pd.max_total_tokens == 512


def test_bench_pd_table_shows_ttft_and_itl_side_by_side() -> None:
    stats = Stats(3, 0.5, 0.4, 0.6, 0.7, 0.8)
    group = GroupSummary(3, 0, stats, Stats(3, 0.01, 0.01, 0.02, 0.03, 0.04), stats, 30, 12, 0,
                         None, None)
    runs = [pd_bench.SetupRun("single", RunSummary("single", 1.0, 30, 30, 12, 3, group, [])),
            pd_bench.SetupRun("pd", error="the router did not start\nmore")]
    table = pd_bench.results_table(runs)
    assert "| single | 3 | 0 | 500.0 | 400.0 | 700.0 | 10.0 | 10.0 | 30.0 | 12.0 | |" in table
    assert "| pd | - |" in table and table.endswith("the router did not start |")
