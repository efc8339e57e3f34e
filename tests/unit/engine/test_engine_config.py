"""EngineConfig: each part refuses what it cannot run, with the flag to change (that the
engine package stands without the server's: tests/e2e/engine/test_engine_imports.py)."""

from __future__ import annotations

import pytest

from hicache.config import CacheConfig, ConfigError
from hicache.engine.config import (
    CPU_CHUNKED_PREFILL_SIZE,
    CPU_PROMPT_SHARE_TOKENS,
    EngineConfig,
    ModelLoadConfig,
    RuntimeConfig,
    SchedulerLimits,
    SchedulingConfig,
)
from hicache.model.loader import LoadFormat
from hicache.storage.config import StorageConfig


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: ModelLoadConfig(model_path="m", preset="tiny"),
         "either --model-path or --model-preset"),
        (lambda: ModelLoadConfig(preset="no-such-preset"), "--model-preset 'no-such-preset'"),
        (lambda: ModelLoadConfig(load_format="safetensors"), "--load-format"),
        (lambda: ModelLoadConfig(load_format="auto"), "--load-format auto reads the weights"),
        (lambda: ModelLoadConfig(dtype="float8"), "unknown dtype 'float8'"),
        (lambda: ModelLoadConfig(device="gpu0"), "--device 'gpu0'"),
        (lambda: ModelLoadConfig(context_length=0), "--context-length must be >= 1"),
        (lambda: SchedulingConfig(max_running_requests=0), "--max-running-requests"),
        (lambda: SchedulingConfig(chunked_prefill_size=0), "--chunked-prefill-size"),
        (lambda: SchedulingConfig(max_total_tokens=0), "--max-total-tokens must be >= 1"),
        (lambda: SchedulingConfig(mem_fraction_static=1.5), "--mem-fraction-static"),
        (lambda: SchedulingConfig(mem_fraction_static=0.0), "--mem-fraction-static"),
        (lambda: RuntimeConfig(num_threads=0), "--num-threads must be >= 1"),
        (lambda: EngineConfig(
            scheduling=SchedulingConfig(disable_radix_cache=True),
            cache=CacheConfig(enable_hierarchical_cache=True)), "--disable-radix-cache"),
        (lambda: EngineConfig(
            scheduling=SchedulingConfig(disable_radix_cache=True),
            storage=StorageConfig(backend="file")), "--hicache-storage-backend"),
    ],
)
def test_invalid_configs_say_what_to_change(make: object, words: str) -> None:
    with pytest.raises(ConfigError) as error:
        make()  # type: ignore[operator]
    assert words in str(error.value)


def test_valid_parts_normalise_and_combine() -> None:
    model = ModelLoadConfig(model_path="m", load_format="dummy", dtype="bf16", device="cuda:1")
    assert model.load_format is LoadFormat.DUMMY
    assert ModelLoadConfig(model_path="m").resolved_load_format is LoadFormat.AUTO
    assert ModelLoadConfig().resolved_load_format is LoadFormat.DUMMY
    # No prefix cache and no tiers behind it is a valid baseline.
    EngineConfig(scheduling=SchedulingConfig(disable_radix_cache=True))


def test_scheduling_hands_the_scheduler_its_slice() -> None:
    scheduling = SchedulingConfig(
        max_running_requests=3, chunked_prefill_size=64, disable_radix_cache=True
    )
    assert scheduling.scheduler_limits(500, "cpu") == SchedulerLimits(
        max_running_requests=3, chunked_prefill_size=64, max_context_len=500,
        enable_prefix_cache=False,
    )
    defaults = SchedulingConfig().scheduler_limits(500, "cuda")
    assert defaults.max_running_requests == SchedulerLimits.max_running_requests
    assert defaults.chunked_prefill_size == SchedulerLimits.chunked_prefill_size
    assert defaults.enable_prefix_cache
    assert defaults.prompt_share_tokens is None
    # On the CPU a step's prompt tokens default to fewer, and a step holding a few
    # hundred takes no further prompt (TTFT; see the constants); a chunk given by hand
    # is shared as given.
    cpu = SchedulingConfig().scheduler_limits(500, "cpu")
    assert cpu.chunked_prefill_size == CPU_CHUNKED_PREFILL_SIZE < defaults.chunked_prefill_size
    assert cpu.prompt_share_tokens == CPU_PROMPT_SHARE_TOKENS < CPU_CHUNKED_PREFILL_SIZE
    given = SchedulingConfig(chunked_prefill_size=512).scheduler_limits(500, "cpu")
    assert given.chunked_prefill_size == 512 and given.prompt_share_tokens is None
    # The prompt rows a step keeps logits for, which the memory reserve is sized by.
    assert SchedulingConfig().resolved_logit_rows("cpu") == CPU_PROMPT_SHARE_TOKENS
    assert SchedulingConfig(chunked_prefill_size=512).resolved_logit_rows("cpu") == 512
    assert SchedulingConfig().resolved_logit_rows("cuda") == SchedulerLimits.chunked_prefill_size

