"""The engine's flags -> EngineConfig: defaults as they always were, every flag lands."""

from __future__ import annotations

import argparse
import json

import pytest

from hicache.config import CacheConfig, ConfigError, IOBackendKind, MemLayout, WritePolicy
from hicache.engine.config import (
    EngineConfig,
    ModelLoadConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulingConfig,
)
from hicache.model.loader import LoadFormat
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from hicache.server.server_info import server_info_from_args
from hicache.storage.config import PrefetchPolicy, StorageConfig


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(flags))


def test_no_flags_is_the_default_config() -> None:
    config = engine_config_from_args(parse())
    assert config == EngineConfig()
    # The defaults users' command lines have always had.
    assert config.model == ModelLoadConfig(
        model_path=None, load_format=None, preset=None, dtype="auto", device=None,
        context_length=None, served_model_name=None,
    )
    assert config.scheduling == SchedulingConfig(
        max_running_requests=32, chunked_prefill_size=None, max_total_tokens=None,
        mem_fraction_static=None, disable_radix_cache=False,
    )
    # No pool size given: the engine sizes the pools from the machine's memory.
    assert config.cache == CacheConfig()
    assert config.cache.hicache_ratio is None and config.cache.hicache_size_gb == 0
    assert config.storage == StorageConfig()
    assert config.runtime == RuntimeConfig(num_threads=None)


def test_every_flag_reaches_its_field() -> None:
    extra = {"path": "/l3", "prefetch_threshold": 64}
    args = parse(
        "--model-path", "/models/m", "--load-format", "dummy", "--dtype", "bfloat16",
        "--device", "cpu", "--context-length", "1000",
        "--max-running-requests", "4", "--chunked-prefill-size", "128",
        "--max-total-tokens", "4096", "--mem-fraction-static", "0.5",
        "--num-threads", "3",
        "--page-size", "16", "--enable-hierarchical-cache", "--hicache-ratio", "3",
        "--hicache-size", "1.5", "--hicache-write-policy", "write_back",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "page_first",
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
        "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(extra),
    )
    args.served_model_name = "served"  # serve's own flag
    config = engine_config_from_args(args)
    assert config.model == ModelLoadConfig(
        model_path="/models/m", load_format=LoadFormat.DUMMY, preset=None, dtype="bfloat16",
        device="cpu", context_length=1000, served_model_name="served",
    )
    assert config.scheduling == SchedulingConfig(
        max_running_requests=4, chunked_prefill_size=128, max_total_tokens=4096,
        mem_fraction_static=0.5, disable_radix_cache=False,
    )
    assert config.cache == CacheConfig(
        page_size=16, enable_hierarchical_cache=True, hicache_ratio=3.0, hicache_size_gb=1.5,
        write_policy=WritePolicy.WRITE_BACK, io_backend=IOBackendKind.DIRECT,
        mem_layout=MemLayout.PAGE_FIRST,
    )
    assert config.storage.backend == "file"
    assert config.storage.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE
    assert config.storage.prefetch_threshold == 64
    assert dict(config.storage.backend_extra) == {"path": "/l3"}
    assert config.runtime == RuntimeConfig(num_threads=3)
    assert engine_config_from_args(parse("--model-preset", "tiny")).model.preset == "tiny"
    assert engine_config_from_args(parse("--disable-radix-cache")).scheduling.disable_radix_cache
    assert config.parallel == ParallelConfig(tp_size=1)
    hints = engine_config_from_args(parse(
        "--hicache-pin-max-fraction", "0.6", "--hicache-pin-tenant-fraction", "0.1",
        "--hicache-hint-max-ttl-s", "3600", "--hicache-retain-ttl-s", "30",
    )).cache
    assert (hints.pin_max_fraction, hints.pin_tenant_fraction) == (0.6, 0.1)
    assert (hints.hint_max_ttl_s, hints.retain_ttl_s) == (3600.0, 30.0)
    for flag in ("--tp-size", "--tensor-parallel-size"):  # ours and SGLang's long name
        assert engine_config_from_args(parse(flag, "2")).parallel == ParallelConfig(tp_size=2)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--model-path", "m", "--model-preset", "tiny"), "either --model-path or"),
        (("--num-threads", "0"), "--num-threads"),
        (("--max-total-tokens", "0"), "--max-total-tokens"),
        (("--disable-radix-cache", "--enable-hierarchical-cache"), "--disable-radix-cache"),
        (("--hicache-ratio", "1"), "--hicache-ratio must be greater than 1"),
        (("--tp-size", "0"), "--tp-size must be >= 1"),
        (("--hicache-pin-max-fraction", "1.5"), "--hicache-pin-max-fraction"),
        (("--hicache-pin-tenant-fraction", "-0.1"), "--hicache-pin-tenant-fraction"),
        (("--hicache-hint-max-ttl-s", "inf"), "--hicache-hint-max-ttl-s"),
        (("--hicache-hint-max-ttl-s", "10", "--hicache-retain-ttl-s", "60"),
         "--hicache-retain-ttl-s"),
    ],
)
def test_bad_flags_fail_naming_the_flag(flags: tuple[str, ...], words: str) -> None:
    with pytest.raises(ConfigError) as error:
        engine_config_from_args(parse(*flags))
    assert words in str(error.value)


def test_help_documents_num_threads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    assert "--num-threads N" in out and "OMP_NUM_THREADS" in out


def test_server_info_reports_the_hint_flags() -> None:
    info = server_info_from_args(parse("--hicache-pin-tenant-fraction", "0.1"))
    assert {key: info.server_args[key] for key in (
        "hicache_pin_max_fraction", "hicache_pin_tenant_fraction", "hicache_hint_max_ttl_s",
        "hicache_retain_ttl_s",
    )} == {"hicache_pin_max_fraction": 0.5, "hicache_pin_tenant_fraction": 0.1,
           "hicache_hint_max_ttl_s": 86400.0, "hicache_retain_ttl_s": 600.0}


def test_the_servers_warm_host_fraction_reaches_the_cache_config() -> None:
    """Prefetch hints fill the host pool within the server's --warm-host-fraction."""
    assert engine_config_from_args(parse()).cache.warm_host_fraction == 0.5
    args = parse()
    args.warm_host_fraction = 0.25  # a flag of `hicache serve` (server/serve.py)
    assert engine_config_from_args(args).cache.warm_host_fraction == 0.25
    with pytest.raises(ConfigError, match="--warm-host-fraction"):
        CacheConfig(warm_host_fraction=0.0)
