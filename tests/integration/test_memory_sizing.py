"""The KV pools sized from what the machine can spare (``memory.sizing``), the memory the
machine has (``memory.machine_memory``: MemAvailable, cgroup v2 and v1 limits, the
environment's cap), and the engine choosing between flags and auto-sizing."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from hicache.config import ConfigError
from hicache.engine.build import build_engine
from hicache.engine.config import CPU_KV_POOL_TOKENS, EngineConfig, SchedulingConfig
from hicache.memory import machine_memory
from hicache.memory.machine_memory import (
    AVAILABLE_MEMORY_ENV,
    AvailableMemory,
    available_memory,
    cgroup_headroom,
    parse_bytes,
)
from hicache.memory.sizing import (
    AUTO_HOST_RATIO,
    MACHINE_SHARE,
    MIN_PAGES_PER_REQUEST,
    RESERVE_BASE_BYTES,
    SizingInputs,
    machine_share_bytes,
    plan_pools,
    reserve_bytes,
)
from hicache.server.engine_args import engine_config_from_args
from tests.server_fixtures import parse_test_args

GB = 10**9
MB = 10**6
# SmolLM2-135M's float32 page of 16 tokens: 30 layers x 2 x 3 KV heads x 64 x 4 B x 16.
PAGE = 737_280
CPU_CAP_PAGES = CPU_KV_POOL_TOKENS // 16


def cpu_inputs(available_gb: float | None, **changes: object) -> SizingInputs:
    """SmolLM2 on the CPU with every default: L2 on, no pool flag."""
    inputs = SizingInputs(
        available=(AvailableMemory(int(available_gb * GB), "MemAvailable")
                   if available_gb is not None else None),
        resident_bytes=int(1.6 * GB), weights_bytes=540 * MB, reserve_bytes=400 * MB,
        page_bytes=PAGE, page_size=16, max_running_requests=32, hierarchical=True,
        device_in_host_memory=True, max_device_pages=CPU_CAP_PAGES,
    )
    return replace(inputs, **changes)  # type: ignore[arg-type]


def test_plenty_of_memory_keeps_the_default_pools() -> None:
    plan = plan_pools(cpu_inputs(20.0))
    assert (plan.device_pages, plan.host_pages) == (CPU_CAP_PAGES, 2 * CPU_CAP_PAGES)
    assert (plan.device_source, plan.host_source, plan.auto_sized) == ("auto", "auto", True)
    assert plan.pools_in_host_memory_bytes <= plan.budget_bytes  # type: ignore[operator]
    assert "fits" in plan.reason


def available_for(budget: int, reserve: int = 400 * MB) -> float:
    """The available memory (GB) that leaves ``budget`` for the pools of ``cpu_inputs``."""
    available = (budget + reserve) * MACHINE_SHARE // (MACHINE_SHARE - 1)
    if machine_share_bytes(available) < available // MACHINE_SHARE:  # the share's cap
        available = budget + reserve + machine_share_bytes(available)
    while available - machine_share_bytes(available) - reserve > budget:
        available -= 1
    while available - machine_share_bytes(available) - reserve < budget:
        available += 1
    return available / GB


def test_a_small_machine_shrinks_both_pools_keeping_the_host_pool_twice_the_device() -> None:
    """What refused to start before: 1 GB available after the weights (a ~3 GB machine)."""
    plan = plan_pools(cpu_inputs(1.0, resident_bytes=0))
    budget = 1 * GB - GB // MACHINE_SHARE - 400 * MB
    assert plan.budget_bytes == budget
    assert plan.device_pages == budget // (3 * PAGE)
    assert plan.host_pages == AUTO_HOST_RATIO * plan.device_pages
    assert plan.pools_in_host_memory_bytes <= budget
    assert plan.announced_bytes <= 1 * GB  # resident (0 here) + reserve + pools
    assert plan.device_pages >= MIN_PAGES_PER_REQUEST * 32
    assert "shrunk to fit" in plan.reason
    line = plan.describe()
    for words in ("available 1.000 GB (MemAvailable; 0.125 GB of it left to the machine)",
                  "reserve 0.400 GB",
                  f"device pool {plan.device_pages * 16} tokens", "host pool", "announced"):
        assert words in line


def test_below_the_floor_is_refused_naming_what_is_missing() -> None:
    floor_bytes = MIN_PAGES_PER_REQUEST * 32 * 3 * PAGE  # device + host twice it
    just_enough = available_for(floor_bytes)
    assert plan_pools(cpu_inputs(just_enough, resident_bytes=0)).device_pages == 128
    with pytest.raises(ConfigError) as refused:
        plan_pools(cpu_inputs(just_enough - 0.001, resident_bytes=0))
    message = str(refused.value)
    for words in ("not enough memory for the KV pools", "--max-running-requests 32",
                  "128 pages", "--max-total-tokens", "--disable-hierarchical-cache",
                  "reserve of 0.400 GB", "left to the rest of the machine"):
        assert words in message
    # Fewer running requests need fewer pages: the same memory then serves.
    assert plan_pools(cpu_inputs(just_enough - 0.001, resident_bytes=0,
                                 max_running_requests=16)).device_pages > 64


def test_without_the_host_pool_the_device_pool_takes_the_budget() -> None:
    plan = plan_pools(cpu_inputs(1.0, resident_bytes=0, hierarchical=False))
    assert plan.host_pages == 0 and plan.host_source == "off"
    assert plan.device_pages == (GB - GB // MACHINE_SHARE - 400 * MB) // PAGE


def test_tensor_parallel_ranks_split_the_budget() -> None:
    one = plan_pools(cpu_inputs(4.0, resident_bytes=500 * MB))
    two = plan_pools(cpu_inputs(4.0, resident_bytes=500 * MB, tp_size=2))
    # Each of two ranks: half of what is left once the other rank's process is counted.
    machine = 4 * GB // MACHINE_SHARE
    assert two.budget_bytes == (4 * GB - machine - 500 * MB) // 2 - 400 * MB
    assert one.budget_bytes == 4 * GB - machine - 400 * MB
    assert two.pools_in_host_memory_bytes <= two.budget_bytes  # type: ignore[operator]
    assert 2 * two.pools_in_host_memory_bytes < one.pools_in_host_memory_bytes


def test_unknown_available_memory_keeps_the_fixed_defaults() -> None:
    plan = plan_pools(cpu_inputs(None))
    assert (plan.device_pages, plan.host_pages) == (CPU_CAP_PAGES, 2 * CPU_CAP_PAGES)
    assert plan.budget_bytes is None and "unknown" in plan.reason


def test_a_given_device_pool_gets_an_auto_host_pool_or_a_clear_refusal() -> None:
    """--max-total-tokens 16384 alone: the host pool is twice it where that fits, less
    where not, and refused (never the device pool shrunk) where not even more than it."""
    given = {"device_pages": 1024, "device_flag": "--max-total-tokens 16384", "resident_bytes": 0}
    roomy = plan_pools(cpu_inputs(8.0, **given))
    assert (roomy.device_pages, roomy.host_pages) == (1024, 2048)
    assert (roomy.device_source, roomy.host_source) == ("flags", "auto")
    tight = plan_pools(cpu_inputs(available_for(int(2.5 * 1024 * PAGE)), **given))
    assert tight.device_pages == 1024 and 1024 < tight.host_pages < 2048
    with pytest.raises(ConfigError, match=r"--max-total-tokens 16384 gives a device pool of "
                                          r"1024 pages .* the host pool must be larger"):
        plan_pools(cpu_inputs(1.07, **given))


def test_gpu_device_pool_by_default_shrinks_to_a_host_pool_that_fits() -> None:
    """On CUDA the device pool is GPU memory: only the host pool takes host memory, and a
    device pool by the default fraction shrinks (a given fraction is refused instead)."""
    gpu = {"device_pages": 100_000, "device_in_host_memory": False, "resident_bytes": 0}
    roomy = plan_pools(cpu_inputs(200.0, **gpu))
    assert (roomy.device_pages, roomy.host_pages, roomy.device_source) == (
        100_000, 200_000, "gpu")
    assert roomy.pools_in_host_memory_bytes == roomy.host_pool_bytes
    half = plan_pools(cpu_inputs(available_for(150_000 * PAGE), **gpu))
    assert half.device_pages == 100_000 and half.host_pages == 150_000
    short = plan_pools(cpu_inputs(available_for(50_000 * PAGE), **gpu))
    assert short.host_pages == 2 * short.device_pages == 50_000
    assert "shrunk" in short.reason
    with pytest.raises(ConfigError, match=r"--mem-fraction-static 0\.9 gives"):
        plan_pools(cpu_inputs(available_for(50_000 * PAGE), **gpu,
                              device_flag="--mem-fraction-static 0.9"))


def test_the_reserve_covers_a_step_of_activations_on_the_cpu_only() -> None:
    cpu = reserve_bytes(256, 576, 1536, 49152, 4, activations_on_host=True)
    assert cpu > RESERVE_BASE_BYTES
    assert reserve_bytes(256, 576, 1536, 49152, 4, activations_on_host=False) == (
        RESERVE_BASE_BYTES)
    assert reserve_bytes(512, 576, 1536, 49152, 4, activations_on_host=True) > cpu
    # Rows that keep no logits cost their activations only; never more rows than tokens.
    fewer = reserve_bytes(1024, 576, 1536, 49152, 4, activations_on_host=True, logit_rows=288)
    assert fewer - RESERVE_BASE_BYTES == 2 * 4 * (1024 * (4 * 576 + 3 * 1536) + 288 * 49152)
    assert reserve_bytes(256, 576, 1536, 49152, 4, activations_on_host=True,
                         logit_rows=1000) == cpu


# ------------------------------------------------------------------ machine memory
def test_parse_bytes() -> None:
    assert parse_bytes("3000000000", "X") == 3 * GB
    assert parse_bytes("3G", "X") == 3 << 30
    assert parse_bytes("512m", "X") == 512 << 20
    assert parse_bytes("1.5GiB", "X") == int(1.5 * (1 << 30))
    with pytest.raises(ValueError, match="X='lots'"):
        parse_bytes("lots", "X")


def test_the_environment_caps_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "1G")
    assert available_memory() == AvailableMemory(1 << 30, AVAILABLE_MEMORY_ENV)
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(1 << 60))  # above what there is: no cap
    seen = available_memory()
    assert seen is not None and seen.source != AVAILABLE_MEMORY_ENV


def _write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_cgroup_v2_headroom_of_the_own_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup2"
    _write(mount, {})  # the root has no memory.max
    _write(mount / "slice", {"memory.max": f"{4 * GB}\n", "memory.current": f"{1 * GB}\n",
                             "memory.stat": "anon 1\ninactive_file 0\n"})
    _write(mount / "slice" / "job", {
        "memory.max": "max\n", "memory.current": f"{GB}\n",
    })
    _write(mount / "slice" / "box", {
        "memory.max": f"{2 * GB}\n", "memory.current": f"{int(1.5 * GB)}\n",
        "memory.stat": f"active_file 5\ninactive_file {100 * MB}\n",
    })
    mountinfo = f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n"
    # A limited cgroup and an unlimited one under a limited parent.
    assert cgroup_headroom("0::/slice/box\n", mountinfo) == [
        AvailableMemory(int(0.5 * GB) + 100 * MB, "cgroup v2 /slice/box"),
        AvailableMemory(3 * GB, "cgroup v2 /slice"),
    ]
    assert cgroup_headroom("0::/slice/job\n", mountinfo) == [
        AvailableMemory(3 * GB, "cgroup v2 /slice")
    ]
    assert cgroup_headroom("0::/\n", mountinfo) == []


def test_cgroup_v1_headroom_and_a_container_mount(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    # Inside a container the hierarchy is mounted from the container's own cgroup.
    _write(mount, {"memory.limit_in_bytes": f"{3 * GB}\n",
                   "memory.usage_in_bytes": f"{2 * GB}\n",
                   "memory.stat": f"cache 9\ntotal_inactive_file {200 * MB}\n"})
    mountinfo = textwrap.dedent(f"""\
        35 31 0:32 /docker/abc {mount} rw,relatime - cgroup cgroup rw,memory
        36 31 0:33 / {tmp_path}/cpu rw,relatime - cgroup cgroup rw,cpu
    """)
    cgroups = "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    assert cgroup_headroom(cgroups, mountinfo) == [
        AvailableMemory(1 * GB + 200 * MB, "cgroup v1 /")
    ]
    # "No limit" in v1 is the largest page-aligned value.
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom(cgroups, mountinfo) == []


def test_a_cgroup_limit_bounds_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV, raising=False)
    limit = AvailableMemory(123 * MB, "cgroup v2 /box")
    monkeypatch.setattr(machine_memory, "cgroup_headroom", lambda *_: [limit])
    assert available_memory() == limit


# ------------------------------------------------------------------ the engine's choice
def test_flags_are_told_apart_from_defaults() -> None:
    config = engine_config_from_args(parse_test_args(["--max-total-tokens", "4096"]))
    assert config.scheduling.device_pool_from_flags
    assert not config.cache.host_pool_from_flags
    plain = EngineConfig()
    assert not plain.scheduling.device_pool_from_flags
    assert not plain.cache.host_pool_from_flags
    assert SchedulingConfig(mem_fraction_static=0.5).device_pool_from_flags
    given = engine_config_from_args(parse_test_args(["--hicache-ratio", "3"]))
    assert given.cache.host_pool_from_flags and given.cache.hicache_ratio == 3.0


def _tiny(monkeypatch: pytest.MonkeyPatch, cap: str, *flags: str) -> EngineConfig:
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, cap)
    args = parse_test_args(["--enable-hierarchical-cache", *flags])
    # parse_test_args gives --max-total-tokens; these tests need it unset.
    return engine_config_from_args(args.__class__(**{**vars(args), "max_total_tokens": None}))


def test_the_engine_sizes_its_pools_from_what_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny model with 64 MB available past its reserve: the pools (200 MB by the
    fixed default) shrink to fit, and the engine reports what it chose."""
    cap = RESERVE_BASE_BYTES + 64 * MB
    engine = build_engine(_tiny(monkeypatch, str(cap)))
    try:
        plan = engine.memory_plan
        assert plan is not None and plan.auto_sized
        device, host = engine.cache.device_pool, engine.cache.host_pool
        assert host is not None
        assert (device.num_pages, host.num_pages) == (plan.device_pages, plan.host_pages)
        assert host.num_pages == 2 * device.num_pages < 2 * CPU_CAP_PAGES
        assert plan.pools_in_host_memory_bytes <= plan.budget_bytes  # type: ignore[operator]
        metrics = engine.metrics()
        assert metrics["memory_auto_sized"] == 1.0
        assert metrics["memory_device_pool_bytes"] == device.size_bytes
        assert metrics["memory_host_pool_bytes"] == host.size_bytes
        assert metrics["memory_available_bytes"] <= cap
    finally:
        engine.shutdown()


def test_the_engine_refuses_below_the_floor_and_keeps_the_flags_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="not enough memory for the KV pools"):
        build_engine(_tiny(monkeypatch, "1M"))
    # Explicit flags: today's refusal of a host pool larger than the machine can spare.
    with pytest.raises(ConfigError, match=r"--hicache-size 5\.0 GB gives a host pool of"):
        build_engine(_tiny(monkeypatch, "1G", "--hicache-size", "5"))
