"""Building an engine from an EngineConfig: load the model, size the pools, make the
cache and the scheduler, agree with the other tensor-parallel ranks, start.

``build_engine(config)`` is the one entry point (the server, the engine process and
tests call it); everything else here is a step of it. Nothing here runs after the
engine has started. Under tensor parallelism the steps that must agree across ranks
end in an agreement (``start_agreement``), and the steps between agreements issue no
collective, so a failing rank fails every rank at the same point.

L3 under tensor parallelism: a store configured at start is attached on every rank
(each to its own KV shard), and when one rank's store is unreachable every rank
starts without L3, the error naming that rank (the ranks' caches hold the same
tiers). Attaching a store later, on a running engine, is refused under tensor
parallelism (``Engine.attach_storage``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hicache.attention.backend import make_attention_backend
from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import ConfigError
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.engine.config import (
    CPU_KV_POOL_TOKENS,
    CUDA_GRAPH_MAX_BS,
    EngineConfig,
    RuntimeConfig,
    SchedulingConfig,
)
from hicache.engine.disaggregation import DisaggregationRuntime
from hicache.engine.engine import Engine
from hicache.engine.start_agreement import run_phase
from hicache.engine.thread_governor import ThreadGovernor
from hicache.engine.threads import adaptive_range, apply_num_threads, default_num_threads
from hicache.events.config import KVEventsConfig
from hicache.events.emitter import KVEventEmitter
from hicache.events.publisher import ZmqEventPublisher
from hicache.kernels.few_rows import FEW_ROWS_MAX
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_memory import host_memory_for_pools
from hicache.memory.machine_memory import available_memory, resident_bytes, trim_heap
from hicache.memory.sizing import PoolPlan, SizingInputs, plan_pools, reserve_bytes
from hicache.model.identity import model_identity
from hicache.model.loader import LoadedModel, load_model, resolve_model_dir
from hicache.model.model import CausalLM
from hicache.model.presets import DEFAULT_PRESET

logger = logging.getLogger(__name__)


def engine_device(config: EngineConfig, tp_rank: int = 0) -> torch.device:
    """Where the engine (of tensor-parallel rank ``tp_rank``) computes: ``cuda`` alone
    means the rank's own GPU."""
    name = config.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available")
    if device.type == "cuda" and device.index is None and config.parallel.enabled:
        device = torch.device("cuda", tp_rank)
    return device


def build_engine(
    config: EngineConfig, tp: TPGroup = SINGLE_RANK, start: bool = True,
    on_fatal: Callable[[], None] | None = None,
) -> Engine:
    """Load the model, size the pools, attach L3, start the scheduler thread.

    Sets torch's intra-op threads for the whole process (``config.runtime``).
    ``tp``: build that tensor-parallel rank's engine (every rank calls this). Under
    tensor parallelism the build is two phases, each ending in an agreement of every
    rank (``start_agreement``): after the model, the pools' page counts (the smallest
    any rank asked for), after the cache and the engine, whether each rank's L3 store
    attached. A failure on any rank raises ``RankStartError`` on every rank, naming it.
    ``start`` False: no scheduler thread (a follower rank calls ``run_replica``).
    """
    part, pages = run_phase(
        tp, lambda: _load_part(config, tp), lambda p: (p.plan.device_pages, p.plan.host_pages)
    )
    device_pages = min(d for d, _ in pages)
    host_pages = min(h for _, h in pages) if config.cache.enable_hierarchical_cache else None
    engine, l3_errors = run_phase(
        tp, lambda: _assemble(config, tp, part, device_pages, host_pages, on_fatal),
        _l3_error, lambda built: built.shutdown(),
    )
    _agree_l3(engine.cache, l3_errors)
    return engine.start() if start else engine


@dataclass(frozen=True)
class _RankPart:
    """What one rank builds before the ranks agree on the pools' sizes."""

    device: torch.device
    num_threads: int
    loaded: LoadedModel
    model_path: str | None  # the dir the weights came from (None: a preset's dummy weights)
    weights_name: str
    geometry: KVGeometry  # this rank's share of the KV heads
    plan: PoolPlan  # the pools' page counts this rank can afford (host 0: no host pool)


def _load_part(config: EngineConfig, tp: TPGroup) -> _RankPart:
    """This rank's model and the pool sizes it can afford (no collective)."""
    model = config.model
    device = engine_device(config, tp.rank)
    threads = config.runtime.num_threads
    if threads is None and tp.size > 1:
        threads = max(1, default_num_threads() // tp.size)  # the ranks share the cores
    num_threads = apply_num_threads(threads)
    load_format = model.resolved_load_format
    preset = model.preset if model.model_path is None else None
    model_dir = (
        resolve_model_dir(model.model_path, model.dtype, device) if model.model_path else None
    )
    # A GGUF file is loaded, and its weights identified, through its converted dir.
    model_path = str(model_dir.path) if model_dir is not None else None
    loaded = load_model(
        model_path, load_format, preset, model.dtype, device, tp=tp if tp.size > 1 else None
    )
    _set_up_compute(loaded.model, config.runtime, device)
    # This rank's share of the KV heads (all of them without tensor parallelism).
    geometry = loaded.model.kv_geometry() if tp.size > 1 else loaded.config.kv_geometry()
    # Ranks may hold different numbers of KV heads (different page bytes), and a page
    # id means the same tokens on every rank: the ranks take the smallest counts.
    plan = _plan_pools(config, device, loaded, geometry, tp)
    logger.info("%s%s", f"tp rank {tp.rank}: " if tp.size > 1 else "", plan.describe())
    weights_name = model_dir.name if model_dir else f"dummy-{preset or DEFAULT_PRESET}"
    return _RankPart(device, num_threads, loaded, model_path, weights_name, geometry, plan)


def _plan_pools(
    config: EngineConfig, device: torch.device, loaded: LoadedModel, geometry: KVGeometry,
    tp: TPGroup,
) -> PoolPlan:
    """The pools' sizes this rank can afford: from the flags where given, else from the
    memory the machine can spare (``memory.sizing``), measured now that the weights are
    in memory."""
    scheduling, cache_config = config.scheduling, config.cache
    page_size = cache_config.page_size
    page_bytes = geometry.page_bytes(page_size)
    hierarchical = cache_config.enable_hierarchical_cache
    on_gpu = device.type == "cuda"
    # On the CPU only --max-total-tokens sizes the device pool (the fraction is of GPU memory).
    device_given = scheduling.max_total_tokens is not None or (
        on_gpu and scheduling.mem_fraction_static is not None
    )
    fixed_pages = (
        max(2, _kv_pool_tokens(scheduling, device, geometry.bytes_per_token) // page_size)
        if device_given or on_gpu else None
    )
    # The loader's freed temporaries go back to the system before this process is measured.
    trim_heap()
    model = loaded.config
    inputs = SizingInputs(
        available=available_memory(), resident_bytes=resident_bytes() or 0,
        weights_bytes=_weights_bytes(loaded.model),
        reserve_bytes=reserve_bytes(
            max(scheduling.resolved_chunked_prefill_size(device.type),
                scheduling.max_running_requests),
            model.hidden_size, model.intermediate_size, model.vocab_size,
            next(loaded.model.parameters()).element_size(), activations_on_host=not on_gpu,
            logit_rows=(scheduling.resolved_logit_rows(device.type)
                        + scheduling.max_running_requests),
        ),
        page_bytes=page_bytes, page_size=page_size,
        max_running_requests=scheduling.max_running_requests, hierarchical=hierarchical,
        device_in_host_memory=not on_gpu, device_pages=fixed_pages,
        device_flag=(
            f"--max-total-tokens {scheduling.max_total_tokens}"
            if scheduling.max_total_tokens is not None
            else f"--mem-fraction-static {scheduling.mem_fraction_static}" if device_given
            else None
        ),
        max_device_pages=max(2, CPU_KV_POOL_TOKENS // page_size), tp_size=tp.size,
    )
    if not (hierarchical and cache_config.host_pool_from_flags):
        return plan_pools(inputs)
    # The host pool from the flags: the device pool as given (or its fixed default), the
    # host pool refused when it does not fit what the machine can spare, as before sizing.
    device_pages = fixed_pages or inputs.max_device_pages
    return PoolPlan(
        device_pages=device_pages,
        host_pages=cache_config.host_num_pages(device_pages, page_bytes, host_memory_for_pools()),
        page_bytes=page_bytes, page_size=page_size,
        device_source="flags" if device_given else ("gpu" if on_gpu else "default"),
        host_source="flags", device_in_host_memory=not on_gpu, available=inputs.available,
        resident_bytes=inputs.resident_bytes, weights_bytes=inputs.weights_bytes,
        reserve_bytes=inputs.reserve_bytes, reason="sizes from the flags",
    )


def _weights_bytes(model: CausalLM) -> int:
    """Bytes of the model's parameters and buffers (tied weights once), and of the copies
    of its weights it computes with (oneDNN-packed, blocked: ``prepack_weights``)."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) + sum(
        copy.numel() * copy.element_size() for copy in model.weight_copies()
    )


def _assemble(
    config: EngineConfig, tp: TPGroup, part: _RankPart, device_pages: int,
    host_pages: int | None, on_fatal: Callable[[], None] | None,
) -> Engine:
    """This rank's cache and engine over the agreed pool sizes (no collective; the
    scheduler thread is not started)."""
    model, cache_config = config.model, config.cache
    storage, scheduling = config.storage, config.scheduling
    device, page_size = part.device, cache_config.page_size
    positions = part.loaded.config.max_position_embeddings
    if model.context_length is not None and model.context_length > positions:
        raise ConfigError(
            f"--context-length {model.context_length} exceeds the model's {positions} positions"
        )
    context = min(model.context_length or positions, (device_pages - 1) * page_size)
    model_name = model.served_model_name or part.weights_name
    preset = model.preset if model.model_path is None else None
    # KV events describe the cache as a whole: rank 0 publishes them.
    publisher = _start_event_publisher(config.events) if tp.rank == 0 else None
    try:
        # The L3 namespace names the weights (their bytes), not the served name: servers
        # of the same weights share pages whatever they are called, other weights never do.
        cache = HierarchicalCache(
            cache_config, part.geometry, device_pages, device,
            model_name=model_identity(part.model_path, model.resolved_load_format, preset,
                                      device),
            # Passed even when L3 is off: its encryption keys apply to a store attached later.
            storage=storage if not scheduling.disable_radix_cache else None,
            events=(KVEventEmitter(page_size, publisher, config.events.pin_events)
                    if publisher is not None else None),
            tp_rank=tp.rank, tp_size=tp.size, host_num_pages=host_pages,
        )
        # Started without L3: a store attached later still enforces --tenant-quotas.
        cache.tenant_quotas = storage.tenant_quotas
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    logger.info(
        "engine: %s on %s (tp rank %d of %d), KV pool %d pages x %d tokens, context %d, "
        "L2 %s, L3 %s, %d torch threads",
        model_name, device, tp.rank, tp.size, device_pages, page_size, context,
        "on" if cache.hierarchical else "off",
        cache.storage.backend.name if cache.storage is not None else "off", part.num_threads,
    )
    try:
        engine = Engine(
            part.loaded, cache, scheduling.scheduler_limits(context, device.type), model_name,
            num_threads=part.num_threads, output_thread=config.runtime.output_thread,
            event_publisher=publisher, model_dir=part.model_path, tp=tp, on_fatal=on_fatal,
            # The ranks share the cores: a governor each would take them all.
            governor=_thread_governor(config.runtime, device) if tp.size == 1 else None,
        )
    except BaseException:
        cache.close()
        if publisher is not None:
            publisher.close()
        raise
    # What the pools came to (the ranks agreed on the smallest counts).
    engine.memory_plan = replace(
        part.plan, device_pages=device_pages, host_pages=host_pages or 0
    )
    try:
        _record_decode_graphs(engine, config, device)
        _calibrate_prefill(engine, device)
    except BaseException:
        engine.shutdown()
        raise
    if config.disaggregation.enabled:
        try:
            engine.disaggregation = DisaggregationRuntime(config.disaggregation, engine.scheduler)
        except BaseException:
            engine.shutdown()
            raise
    return engine


def _record_decode_graphs(engine: Engine, config: EngineConfig, device: torch.device) -> None:
    """On CUDA, the decode step as CUDA graphs (``engine.decode_graphs``) where they apply:
    one rank, an MHA/GQA model, Triton present (its decode kernel reads the lengths on
    the device). A recording that fails or disagrees with the eager step is dropped
    with a warning: the engine then decodes eagerly, as with --disable-cuda-graph."""
    runtime = config.runtime
    if device.type != "cuda" or not runtime.cuda_graph:
        return
    why_not = _decode_graphs_unavailable(engine, device)
    if why_not is None:
        limit = engine.scheduler.limits.max_running_requests
        max_bs = runtime.cuda_graph_max_bs or min(limit, CUDA_GRAPH_MAX_BS)
        began = time.perf_counter()
        try:
            why_not = engine.scheduler.runner.record_decode_graphs(min(max_bs, limit))
        except Exception as error:  # a capture CUDA refused, a kernel that did not build
            logger.exception("decode: recording the CUDA graphs failed")
            why_not = f"recording failed: {error}"
        if why_not is None:
            graphs = engine.scheduler.runner.decode_graphs
            assert graphs is not None
            logger.info(
                "decode: CUDA graphs for batches of up to %d (%d buckets) in %.1f s",
                graphs.max_batch, len(graphs.buckets), time.perf_counter() - began,
            )
            return
    logger.warning("decode: no CUDA graphs (%s); decoding eagerly", why_not)


def _calibrate_prefill(engine: Engine, device: torch.device) -> None:
    """On CUDA, a few timed prefill chunks before serving, so that a fresh engine's first
    load-or-recompute choices are priced (``prefill_calibration.py``). One rank only: the
    ranks of a tensor-parallel group would have to run them together."""
    limits = engine.scheduler.limits
    if device.type != "cuda" or engine.tp.size > 1 or not limits.enable_prefix_cache:
        return
    from hicache.engine.prefill_calibration import calibrate_prefill, describe

    scheduler = engine.scheduler
    began = time.perf_counter()
    try:
        calibration = calibrate_prefill(
            scheduler.runner, engine.cache.device_pool.allocator, scheduler.cost_model,
            engine.model_config.vocab_size, scheduler.limits.chunked_prefill_size,
            sync=torch.cuda.synchronize,
        )
    except Exception:  # a kernel that did not build: the first requests then go unpriced
        logger.exception("prefill: calibrating the cost model failed")
        return
    logger.info("prefill: cost model calibrated in %.1f s, %s",
                time.perf_counter() - began, describe(calibration))


def _decode_graphs_unavailable(engine: Engine, device: torch.device) -> str | None:
    from hicache.kernels.availability import triton_unavailable_reason

    if engine.tp.size > 1:
        return "tensor parallelism: not recorded across ranks yet"
    if engine.model_config.mla is not None:
        return "MLA models plan their attention on the host"
    return triton_unavailable_reason(device)


def _l3_error(engine: Engine) -> str | None:
    """Why this rank's configured L3 store is not attached (None: attached, or none)."""
    return engine.cache.storage_error if engine.cache.storage is None else None


def _agree_l3(cache: HierarchicalCache, l3_errors: list[str | None]) -> None:
    """Under tensor parallelism the ranks' caches must hold the same tiers: when a rank's
    store was unreachable at start (it starts without L3, as one rank alone would), every
    rank starts without L3, its error naming that rank."""
    failed = [(rank, error) for rank, error in enumerate(l3_errors) if error is not None]
    if len(l3_errors) < 2 or not failed:
        return
    cache.detach_storage()  # nothing is in flight yet
    cache.storage_error = "; ".join(
        f"tensor-parallel rank {rank}: {error}" for rank, error in failed
    )
    logger.error("L3 off on every rank: %s", cache.storage_error)


def _thread_governor(runtime: RuntimeConfig, device: torch.device) -> ThreadGovernor | None:
    span = adaptive_range(runtime.num_threads, device.type)
    if span is None:
        return None
    logger.info("torch threads: %d while other work keeps a core busy, else %d", *span)
    return ThreadGovernor(*span)


def _start_event_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The KV event publisher, bound and running; None when events are off.

    Raises EventPublisherError (an OSError) when its addresses cannot be bound.
    """
    if not config.enabled:
        return None
    return ZmqEventPublisher(config).start()


def _set_up_compute(model: CausalLM, runtime: RuntimeConfig, device: torch.device) -> None:
    """The attention backend, and packed weights or compiled layer blocks, as configured."""
    model.attention_backend = make_attention_backend(runtime.attention_backend, device)
    if runtime.enable_torch_compile:
        model.compile_blocks()
    elif runtime.prepack_weights and device.type == "cpu":
        # oneDNN-packed projection weights: 1.2-2.2x faster CPU decode steps (float32).
        model.prepack_weights()
    logger.info(
        "compute: attention backend %s, %s", model.attention_backend.name,
        "compiled layer blocks" if runtime.enable_torch_compile
        else ("prepacked weights, " + _few_rows_path(model))
        if model.packed_lm_head is not None else "plain weights",
    )


def _few_rows_path(model: CausalLM) -> str:
    """Which weights a decode step's few rows multiply by (``CausalLM.prepack_weights``)."""
    if model.few_rows_lm_head is not None:
        return f"products of up to {FEW_ROWS_MAX} rows over blocked weights (few-row kernel)"
    return ("one-row products over "
            + ("packed" if model.packed_from_rows == 1 else "column-major") + " weights")


def _kv_pool_tokens(
    scheduling: SchedulingConfig, device: torch.device, bytes_per_token: int
) -> int:
    if scheduling.max_total_tokens is not None:
        return scheduling.max_total_tokens
    if device.type != "cuda":
        return CPU_KV_POOL_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * scheduling.resolved_mem_fraction_static) // bytes_per_token
