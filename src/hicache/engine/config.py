"""EngineConfig: everything ``build_engine`` needs, as frozen dataclasses, one per part.

The engine never sees command-line flags: the server (``hicache.server.engine_args``)
turns them into an EngineConfig, and a program embedding the engine builds one
directly (``EngineConfig()`` is the tiny dummy model with every default). Each
part checks itself when built and the whole checks how the parts combine, so an
invalid configuration fails with a ConfigError before any weights are loaded.
Messages name the command-line flag of the field (the field's name with dashes),
as CacheConfig's do: that is what most users have to change.

Each default has one home: the scheduler's limits are SchedulerLimits' (below), the
cache's and L3's are CacheConfig's and StorageConfig's, and the parts here read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hicache.attention.backend import ATTENTION_BACKENDS
from hicache.config import CacheConfig, ConfigError, parse_enum
from hicache.disaggregation.config import DisaggregationConfig
from hicache.events.config import KVEventsConfig
from hicache.model.config import parse_dtype
from hicache.model.loader import LoadFormat
from hicache.model.presets import PRESETS
from hicache.storage.config import StorageConfig

# The KV pool on the CPU, in tokens, when --max-total-tokens is not given: this many
# where the machine can spare the memory, else less (``memory.sizing``).
CPU_KV_POOL_TOKENS = 65536
# GPU: the fraction of free memory the KV pool takes when --mem-fraction-static is not given.
DEFAULT_MEM_FRACTION_STATIC = 0.85
# Prompt tokens per step on the CPU, and how many of them a step may hold before it
# takes no further prompt (``SchedulerLimits.prompt_share_tokens``). Several prompts
# in one big step all wait for all of them: four cold 256-token prompts on
# SmolLM2-135M had a mean TTFT of 7.3 s in steps of 2048 tokens, 4.6 s in steps of 256,
# total time within 2%. One long prompt alone gains from big steps: a 1,024-token
# prompt computed 5% faster in one step than in four of 256 (attention and the
# per-step costs), and cold 1K prompts served 5-14% faster (docs/benchmarks.md). So a
# step holds one prompt's tokens up to 1,024, and a second prompt only while the
# step holds fewer than 256.
CPU_CHUNKED_PREFILL_SIZE = 1024
CPU_PROMPT_SHARE_TOKENS = 256


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which weights, in which dtype, on which device, served under which name."""

    # A Hugging Face style directory or a GGUF file; None: dummy weights of ``preset``.
    model_path: str | None = None
    # None: auto with a model path, dummy without.
    load_format: LoadFormat | None = None
    # The architecture of dummy weights (None: the default preset); only without model_path.
    preset: str | None = None
    dtype: str = "auto"  # auto keeps the checkpoint's (or the preset's) dtype
    device: str | None = None  # None: cuda when available, else cpu
    # Longest prompt + output; None: the model's, capped by the KV pool.
    context_length: int | None = None
    # The name clients send; None: the weights' name (the directory or GGUF file).
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.load_format is not None:
            object.__setattr__(
                self, "load_format", parse_enum(LoadFormat, self.load_format, "--load-format")
            )
        if self.model_path is not None and self.preset is not None:
            raise ConfigError("give either --model-path or --model-preset, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(
                f"--model-preset {self.preset!r}: choose one of {', '.join(sorted(PRESETS))}"
            )
        if self.load_format is LoadFormat.AUTO and self.model_path is None:
            raise ConfigError("--load-format auto reads the weights from --model-path: give it, "
                              "or use --load-format dummy")
        if self.dtype != "auto":
            parse_dtype(self.dtype)  # its ModelConfigError (a ConfigError) lists the choices
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ConfigError(
                    f"--device {self.device!r}: not a device; use cpu, cuda or cuda:N"
                ) from None
        if self.context_length is not None and self.context_length < 1:
            raise ConfigError(f"--context-length must be >= 1, got {self.context_length}")

    @property
    def resolved_load_format(self) -> LoadFormat:
        if self.load_format is not None:
            return self.load_format
        return LoadFormat.AUTO if self.model_path is not None else LoadFormat.DUMMY


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler works within, resolved for one engine (``SchedulingConfig`` is
    what the user gave; ``SchedulingConfig.scheduler_limits`` makes this from it once the
    model, the device and the pool are known)."""

    max_running_requests: int = 32
    # Prompt tokens computed per step across all prefilling requests.
    chunked_prefill_size: int = 2048
    max_context_len: int = 4096
    enable_prefix_cache: bool = True
    # A step with decode rows carries only the prompt tokens the live cost model prices
    # within this many seconds (``step_budget.py``); None: always the full chunk.
    max_decode_delay_s: float | None = None
    # Or (the smaller applies) this many times the step of the decode rows alone.
    max_decode_delay_factor: float | None = None
    # A step already holding this many prompt tokens takes no further prompt (a long
    # prompt still fills it alone, up to the chunk), and a prompt asking its logprobs
    # (whose rows keep their logits) takes only what is left of this many; None: prompts
    # share every step, up to the chunk.
    prompt_share_tokens: int | None = None


@dataclass(frozen=True)
class SchedulingConfig:
    """Batching limits and the device KV pool's size, as the user gave them.

    The scheduler works within SchedulerLimits, made from this once the model and the
    pool are known (``scheduler_limits``): its context length depends on both.
    """

    max_running_requests: int = SchedulerLimits.max_running_requests
    # None: CPU_CHUNKED_PREFILL_SIZE on the CPU, SchedulerLimits' default elsewhere.
    chunked_prefill_size: int | None = None
    # Device KV pool in tokens; None: mem_fraction_static of free GPU memory, or off the
    # GPU CPU_KV_POOL_TOKENS where the machine can spare it (``memory.sizing``).
    max_total_tokens: int | None = None
    # GPU: the fraction of the memory left after the weights that the KV pool takes;
    # None: not given (DEFAULT_MEM_FRACTION_STATIC, and the pool may shrink to fit host
    # memory for the host pool; a given fraction is never shrunk).
    mem_fraction_static: float | None = None
    # No prefix caching at all (a baseline for benchmarks).
    disable_radix_cache: bool = False
    # Milliseconds of prompt compute a step may add beside decode rows (``step_budget.py``);
    # None: every step takes the full chunk.
    max_decode_delay_ms: float | None = None
    # The same delay as a multiple of the decode rows' own step (both given: the smaller).
    max_decode_delay_factor: float | None = None

    def __post_init__(self) -> None:
        chunk = self.chunked_prefill_size
        if self.max_running_requests < 1 or (chunk is not None and chunk < 1):
            raise ConfigError("--max-running-requests and --chunked-prefill-size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError("--max-total-tokens must be >= 1")
        fraction = self.mem_fraction_static
        if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
        delay = self.max_decode_delay_ms
        if delay is not None and not (math.isfinite(delay) and delay > 0):
            raise ConfigError(f"--max-decode-delay-ms must be > 0, got {delay}")
        factor = self.max_decode_delay_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"--max-decode-delay-factor must be > 0, got {factor}")

    @property
    def device_pool_from_flags(self) -> bool:
        """Whether the device pool's size was given (--max-total-tokens,
        --mem-fraction-static)."""
        return self.max_total_tokens is not None or self.mem_fraction_static is not None

    @property
    def resolved_mem_fraction_static(self) -> float:
        if self.mem_fraction_static is None:
            return DEFAULT_MEM_FRACTION_STATIC
        return self.mem_fraction_static

    def resolved_chunked_prefill_size(self, device_type: str) -> int:
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        if device_type == "cpu":
            return CPU_CHUNKED_PREFILL_SIZE
        return SchedulerLimits.chunked_prefill_size

    def resolved_prompt_share_tokens(self, device_type: str) -> int | None:
        """``SchedulerLimits.prompt_share_tokens``: the CPU's default steps only (a chunk
        given by hand is shared as given)."""
        if device_type == "cpu" and self.chunked_prefill_size is None:
            return CPU_PROMPT_SHARE_TOKENS
        return None

    def resolved_logit_rows(self, device_type: str) -> int:
        """The most prompt rows a step keeps logits for (a prompt's logprobs): the share
        where steps have one (the scheduler holds such prompts to it), else the chunk."""
        share = self.resolved_prompt_share_tokens(device_type)
        return share if share is not None else self.resolved_chunked_prefill_size(device_type)

    def scheduler_limits(self, max_context_len: int, device_type: str) -> SchedulerLimits:
        return SchedulerLimits(
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.resolved_chunked_prefill_size(device_type),
            max_context_len=max_context_len,
            enable_prefix_cache=not self.disable_radix_cache,
            max_decode_delay_s=(
                None if self.max_decode_delay_ms is None else self.max_decode_delay_ms / 1000
            ),
            max_decode_delay_factor=self.max_decode_delay_factor,
            prompt_share_tokens=self.resolved_prompt_share_tokens(device_type),
        )


# The largest decode batch recorded by default: larger batches run eagerly, where
# launching kernels costs little next to the work of so many rows.
CUDA_GRAPH_MAX_BS = 160


@dataclass(frozen=True)
class RuntimeConfig:
    """How the engine computes.

    ``num_threads``: torch's intra-op threads (the OpenMP/MKL pool a CPU forward
    splits its matrix products over); None lets the engine pick it as it runs on a CPU
    (``engine.threads.adaptive_range``, ``engine.thread_governor``), else
    ``engine.threads.default_num_threads``.
    The setting is process-wide: it applies to every torch call in the process,
    and the last engine built sets it.

    ``attention_backend``: how attention reads the paged pool (``auto``: the fastest
    that runs on the device; see ``hicache.attention.backend``).
    ``prepack_weights``: on the CPU, multiply by oneDNN-packed copies of the weights
    (float32; ``hicache.model.linear``). ``enable_torch_compile``: compile the layers'
    math around attention instead (it replaces packing). ``output_thread``: detokenize
    and stream outputs on their own thread, beside the scheduler (False: on the
    scheduler thread, after each step; ``hicache.engine.output_thread``).
    ``cuda_graph``: on CUDA, record the decode step once per batch-size bucket up to
    ``cuda_graph_max_bs`` sequences (None: the scheduler's running-request limit,
    at most ``CUDA_GRAPH_MAX_BS``) and replay it (``hicache.engine.decode_graphs``).
    """

    num_threads: int | None = None
    attention_backend: str = "auto"
    prepack_weights: bool = True
    enable_torch_compile: bool = False
    output_thread: bool = True
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention-backend {self.attention_backend!r}: choose one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes the model is split over (tensor parallelism).

    ``tp_size`` ranks each hold a shard of every layer and of every token's KV; each
    runs the same scheduler over its own cache, rank 0 leading (``engine/replication.py``).
    """

    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {self.tp_size}")

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine: model, scheduling, L1/L2 cache, L3 storage, runtime, KV events."""

    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    events: KVEventsConfig = field(default_factory=KVEventsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    def __post_init__(self) -> None:
        if self.disaggregation.enabled and self.parallel.enabled:
            raise ConfigError("--disaggregation-mode does not support --tp-size > 1 yet")
        if self.scheduling.disable_radix_cache and (
            self.cache.enable_hierarchical_cache or self.storage.enabled
        ):
            raise ConfigError(
                "--disable-radix-cache turns prefix caching off: drop "
                "--enable-hierarchical-cache and --hicache-storage-backend with it"
            )
