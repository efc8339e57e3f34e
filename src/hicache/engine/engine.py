"""Engine: the model, the hierarchical cache and the scheduler thread, behind EngineProtocol.

``build_engine(config)`` turns an EngineConfig (``engine/config.py``; the server makes
one from its flags) into a running engine;
``Engine.generate`` is what the HTTP server streams from.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import ConfigError
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.engine.api import GenerateOutput, GenerateRequest, validate_request
from hicache.engine.cache_ops import CACHE_OPS
from hicache.engine.config import (
    CPU_KV_POOL_TOKENS,
    CUDA_GRAPH_MAX_BS,
    EngineConfig,
    RuntimeConfig,
    SchedulingConfig,
)
from hicache.engine.disaggregation import DisaggregationRuntime
from hicache.engine.grammar import Grammars
from hicache.engine.output_thread import DroppedSink, LoopSink, Stream
from hicache.engine.replication import AddRequest, ReplicatedScheduler
from hicache.engine.request import Req
from hicache.engine.sampling import make_generator
from hicache.engine.scheduler import Scheduler, SchedulerConfig
from hicache.engine.start_agreement import run_phase
from hicache.engine.thread_governor import ThreadGovernor
from hicache.engine.threads import (
    adaptive_range,
    apply_num_threads,
    default_num_threads,
    set_thread_count,
)
from hicache.events.config import KVEventsConfig
from hicache.events.emitter import KVEventEmitter
from hicache.events.publisher import ZmqEventPublisher
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_memory import host_memory_for_pools
from hicache.memory.machine_memory import available_memory, resident_bytes, trim_heap
from hicache.memory.sizing import PoolPlan, SizingInputs, plan_pools, reserve_bytes
from hicache.model.attention_backend import make_attention_backend
from hicache.model.detokenizer import IncrementalDetokenizer
from hicache.model.identity import model_identity
from hicache.model.loader import LoadedModel, load_model, resolve_model_dir
from hicache.model.model import CausalLM
from hicache.model.presets import DEFAULT_PRESET
from hicache.storage.base import StorageError
from hicache.storage.config import storage_config
from hicache.storage.controller import StorageMetrics
from hicache.storage.frame import PayloadOrder

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 120.0
# How long a metrics read waits for the ranks' L3 counters (one tick, normally).
GATHER_TIMEOUT_S = 5.0


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: HierarchicalCache,
        config: SchedulerConfig,
        model_name: str,
        num_threads: int | None = None,
        output_thread: bool = True,
        event_publisher: ZmqEventPublisher | None = None,
        model_dir: str | None = None,
        tp: TPGroup = SINGLE_RANK,
        on_fatal: Callable[[], None] | None = None,
        governor: ThreadGovernor | None = None,
    ) -> None:
        """``tp``: this engine is that rank of a tensor-parallel group (rank 0 takes the
        requests; ``run_replica`` runs a follower). ``on_fatal``: called on rank 0's
        scheduler thread when the group failed (the process must end)."""
        self.model = loaded.model
        # The model dir the weights and tokenizer came from (None: dummy weights of a preset).
        self.model_dir = model_dir
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.cache = cache
        self.model_name = model_name
        self.vocab_size = loaded.config.vocab_size
        self.max_context_len = config.max_context_len
        # Compiles requests' grammars where they are submitted (never on rank 0's scheduler
        # thread); a follower compiles the same specs for its own matchers.
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.scheduler = Scheduler(
            self.model, cache, config, self.tokenizer.eos_token_ids, output_thread=output_thread,
            deliver_outputs=tp.rank == 0,
        )
        self.tp = tp
        self.on_fatal = on_fatal
        self.replicated = (
            ReplicatedScheduler(self.scheduler, tp, self._replica_req) if tp.size > 1 else None
        )
        # torch's intra-op threads for the forwards (None: leave torch's setting alone),
        # then as the governor says between steps when the count is the engine's to pick.
        self.num_threads = governor.threads if governor is not None else num_threads
        self.scheduler.governor = governor
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Set by build_engine on a prefill or decode instance (disaggregation).
        self.disaggregation: DisaggregationRuntime | None = None
        # Publishes the cache's KV events (None: off); closed after the cache.
        self.event_publisher = event_publisher
        # How the pools were sized and what was announced (set by build_engine; None for
        # an engine built around a cache made elsewhere).
        self.memory_plan: PoolPlan | None = None

    @property
    def chunked_prefill_size(self) -> int:
        """Prompt tokens per step (the flag's default resolved for the device)."""
        return self.scheduler.config.chunked_prefill_size

    def routing_info(self) -> dict[str, Any]:
        """What a router needs beyond SGLang's server arguments (/get_server_info).

        Where this worker publishes its KV events (the bound addresses: a
        wildcard port resolved; None when events are off), and how it names its
        L3 pages: the chain seed of the radix key namespace for requests without
        an extra key (hex) and the payload-order tag that ends every object name
        (``storage.frame.object_name``; None without a host pool, hence no L3).
        """
        publisher = self.event_publisher
        layout = self.cache.config.mem_layout
        pd = self.disaggregation
        return {
            **(pd.info() if pd is not None else {
                "disaggregation_mode": "null", "disaggregation_bootstrap_port": None,
            }),
            "kv_events_endpoint": publisher.endpoint if publisher else None,
            "kv_events_replay_endpoint": publisher.replay_endpoint if publisher else None,
            "kv_events_topic": publisher.config.topic if publisher else None,
            "hicache_l3_key_seed": self.cache.tree.namespace.seed(None).hex(),
            "hicache_l3_object_order": (
                PayloadOrder.of_layout(layout).tag if self.cache.hierarchical else None
            ),
        }

    @property
    def device(self) -> str:
        """Where the model and the device (L1) pool are."""
        return str(self.cache.device_pool.device)

    @property
    def attention_backend(self) -> str:
        """The attention backend the model runs (``auto`` resolved)."""
        return self.model.attention_backend.name

    # ------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run_scheduler, name="hicache-scheduler", daemon=True,
            )
            self._thread.start()
        return self

    def _run_scheduler(self) -> None:
        # Set again on the thread that runs the forwards: torch reads the process-wide
        # count once per thread (at its first parallel op), so this thread keeps the
        # count it starts with, which is then this engine's own.
        if self.num_threads is not None:
            set_thread_count(self.num_threads)
        if self.replicated is None:
            self.scheduler.run(self._stop)
            return
        try:
            self.replicated.run(self._stop)
        except BaseException:
            logger.exception("tensor-parallel rank 0 failed: the engine cannot go on")
            if self.on_fatal is not None:
                self.on_fatal()
            raise

    def run_replica(self) -> None:
        """A follower rank: run the replicated scheduler on this thread until rank 0 stops
        the group; raises when the group fails."""
        if self.replicated is None or self.tp.rank == 0:
            raise RuntimeError("run_replica is for tensor-parallel ranks above 0")
        if self.num_threads is not None:
            set_thread_count(self.num_threads)
        self.replicated.run(threading.Event())

    def _replica_req(self, add: AddRequest) -> Req:
        """A follower's copy of a request rank 0 took (its outputs are dropped)."""
        request = add.request
        generator = make_generator(request.sampling, self.cache.device_pool.device)
        if generator is not None and add.seed is not None:
            generator.manual_seed(add.seed)
        spec = request.sampling.grammar
        return Req(
            request=request, rid=add.rid, stream=Stream(DroppedSink()),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.input_ids),
            generator=generator, arrived=add.arrived,
            # Rank 0 compiled it when it took the request: the ranks' masks agree.
            grammar=self.grammars.state(spec) if spec is not None else None,
        )

    def shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.disaggregation is not None:
            self.disaggregation.close()
            self.disaggregation = None
        self.cache.close()  # its last events go to the publisher first
        if self.event_publisher is not None:
            self.event_publisher.close()

    # ------------------------------------------------------------ requests
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def validate(self, request: GenerateRequest) -> None:
        validate_request(request, self.vocab_size, self.max_context_len)

    def submit(self, request: GenerateRequest, stream: Stream) -> str:
        """Validate ``request`` (RequestError before anything is queued) and queue it;
        its outputs go to ``stream``. Returns its rid (``request.rid`` or a new one)."""
        self.validate(request)
        if self._thread is None:
            raise RuntimeError("the engine is not running")
        rid = request.rid or uuid.uuid4().hex
        spec = request.sampling.grammar
        self.scheduler.submit(Req(
            request=request, rid=rid, stream=stream,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.input_ids),
            generator=make_generator(request.sampling, self.cache.device_pool.device),
            # Compiled here, on the submitting thread (RequestError: nothing queued).
            grammar=self.grammars.state(spec) if spec is not None else None,
        ))
        return rid

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        outputs: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        if request.sampling.grammar is not None:  # off the loop; submit finds it compiled
            await asyncio.to_thread(self.grammars.compile, request.sampling.grammar)
        rid = self.submit(request, Stream(LoopSink(asyncio.get_running_loop()), outputs))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:  # the caller went away: free what the request holds
                self.scheduler.abort(rid)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def is_idle(self) -> bool:
        return self.scheduler.is_idle()

    # ------------------------------------------------------------- control
    def _on_scheduler(self, fn: Any) -> Any:
        if self._thread is None:
            return fn()
        return self.scheduler.call(fn).result(timeout=_CONTROL_TIMEOUT_S)

    def _run_op(self, name: str) -> Any:
        """A cache operation (``cache_ops``), on every rank's scheduler thread."""
        if self._thread is None:
            return CACHE_OPS[name](self.scheduler)
        return self.scheduler.call_op(name).result(timeout=_CONTROL_TIMEOUT_S)

    def flush_cache(self) -> bool:
        return bool(self._run_op("flush"))

    def check_integrity(self) -> None:
        """Assert the tree and every pool are consistent and nothing leaked (when idle)."""
        self._run_op("check_integrity")

    def evict_device_cache(self) -> int:
        """Push every cached page no request holds out of L1 (host copies stay in L2).

        For benchmarks and tests that need a prefix to sit in L2 only; returns
        the number of device pages freed.
        """
        return int(self._run_op("evict_device_cache"))

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        config = storage_config(backend, policy, extra_config)
        if self.tp.size > 1:
            raise StorageError("L3 under tensor parallelism is not supported yet")

        def attach() -> None:
            if not self.scheduler.is_idle():
                raise StorageError("requests are running: attach L3 only when the server is idle")
            self.cache.attach_storage(config)

        self._on_scheduler(attach)

    def detach_storage(self) -> None:
        """Detach L3 (a cache operation: under tensor parallelism, on every rank)."""
        self._run_op("detach_storage")

    def clear_storage(self) -> None:
        """Remove every page of the L3 store (a cache operation, on every rank)."""
        self._run_op("clear_storage")

    def storage_status(self) -> dict[str, Any]:
        storage = self.cache.storage
        if storage is None:
            return {"attached": False, "error": self.cache.storage_error}
        metrics = storage.metrics()
        return {
            "attached": True,
            "backend": storage.backend.name,
            "prefetch_policy": storage.config.prefetch_policy.value,
            "prefetch_threshold": storage.config.prefetch_threshold,
            "prefetch_timeout_per_ki_token": storage.config.prefetch_timeout_per_ki_token,
            "prefetch_timeout_per_ki_token_in_force_s": storage.prefetch_timeout_per_ki_token_s,
            "breaker": storage.breaker.state.value,
            "metrics": asdict(metrics),
            "backend_stats": asdict(storage.backend.stats()),
        }

    def _l3_totals(self, local: StorageMetrics) -> tuple[StorageMetrics, dict[str, int]]:
        """The L3 counters and backend failures of every rank, summed (alone: this rank's).

        Under tensor parallelism each rank has its own store, whose counters only it
        holds: they are gathered in a tick (``RANK_READS``). When the ranks do not answer
        in time (the group is stopping or failed) rank 0's own are reported.
        """
        assert self.cache.storage is not None
        backend_failures = self.cache.storage.controller.backend_failures()
        if self.replicated is None:
            return local, backend_failures
        try:
            answers = self.scheduler.gather("l3_metrics").result(timeout=GATHER_TIMEOUT_S)
        except FutureTimeoutError as error:
            logger.warning("L3 metrics of rank 0 only: the ranks did not answer (%s)", error)
            return local, backend_failures
        if any(answer is None for answer in answers):  # a rank detached meanwhile
            return local, backend_failures
        failures: dict[str, int] = {}
        for _, rank_failures in answers:
            for reason, count in rank_failures.items():
                failures[reason] = failures.get(reason, 0) + count
        return StorageMetrics.total([m for m, _ in answers]), failures

    def _memory_metrics(self) -> dict[str, float]:
        """The pools' sizing (``memory_*``; /get_server_info's memory block is made from
        them) and this process's resident memory now."""
        plan = self.memory_plan
        if plan is None:
            return {}
        out = {
            "memory_auto_sized": float(plan.auto_sized),
            "memory_device_pool_auto": float(plan.device_source == "auto"),
            "memory_host_pool_auto": float(plan.host_source == "auto"),
            "memory_device_pool_in_host_memory": float(plan.device_in_host_memory),
            "memory_device_pool_bytes": float(plan.device_pool_bytes),
            "memory_device_pool_tokens": float(plan.device_pages * plan.page_size),
            "memory_host_pool_bytes": float(plan.host_pool_bytes),
            "memory_resident_at_sizing_bytes": float(plan.resident_bytes),
            "memory_weights_bytes": float(plan.weights_bytes),
            "memory_reserve_bytes": float(plan.reserve_bytes),
            "memory_announced_bytes": float(plan.announced_bytes),
        }
        if plan.available is not None:
            out["memory_available_bytes"] = float(plan.available.bytes)
        resident = resident_bytes()
        if resident is not None:
            out["memory_resident_bytes"] = float(resident)
        return out

    def metrics(self) -> dict[str, float]:
        cache, sched = self.cache, self.scheduler
        out: dict[str, float] = {f"engine_{k}": float(v) for k, v in
                                 asdict(sched.counters).items()}
        out["engine_running_requests"] = float(sched.num_running)
        governor = sched.governor
        out["engine_torch_threads"] = float(
            governor.threads if governor is not None else (self.num_threads or 0)
        )
        if governor is not None:
            out["engine_other_work_cores"] = governor.others_cores
        out["engine_waiting_requests"] = float(sched.num_waiting)
        prompt = sched.counters.num_prompt_tokens
        cached = (sched.counters.num_cached_device_tokens + sched.counters.num_cached_host_tokens
                  + sched.counters.num_cached_storage_tokens)
        out.update({f"cache_{k}": float(v) for k, v in cache.stats.as_dict().items()})
        if cache.controller is not None:
            out["cache_load_seconds"] = cache.controller.load_seconds
        # After the cache's own counters: its hit rate leaves out tokens prefetched from L3.
        out["cache_hit_rate"] = cached / prompt if prompt else 0.0
        device = cache.device_pool.allocator
        out["device_pool_pages"] = float(device.num_pages)
        out["device_pool_used_pages"] = float(device.num_used_pages)
        if cache.host_pool is not None:
            host = cache.host_pool.allocator
            out["host_pool_pages"] = float(host.num_pages)
            out["host_pool_used_pages"] = float(host.num_used_pages)
            out["host_pool_usage"] = host.num_used_pages / host.num_pages
        storage = cache.storage
        out.update(self._memory_metrics())
        out["storage_attached"] = float(storage is not None)
        if storage is not None:
            metrics = storage.metrics()
            # Under tensor parallelism the counters are summed over the ranks' stores.
            total, backend_failures = self._l3_totals(metrics)
            for key, value in asdict(total).items():
                if key != "failures":
                    out[f"storage_{key}"] = float(value)
            # The controller's reasons (per call) and the backend's (per page): /metrics
            # exports both as one family, told apart by a source label.
            for reason, count in total.failures.items():
                out[f"storage_failures_{reason}"] = float(count)
            for reason, count in backend_failures.items():
                out[f"storage_backend_failures_{reason}"] = float(count)
            out["storage_prefetch_timeout_per_ki_token_s"] = storage.prefetch_timeout_per_ki_token_s
            page_bytes = cache.host_pool.page_bytes if cache.host_pool is not None else 0
            if metrics.prefetch_seconds > 0:
                out["storage_prefetch_gbps"] = (
                    metrics.prefetch_pages_loaded * page_bytes / metrics.prefetch_seconds / 1e9
                )
            if metrics.backup_seconds > 0:
                out["storage_backup_gbps"] = (
                    metrics.backup_pages_stored * page_bytes / metrics.backup_seconds / 1e9
                )
        return out


# ---------------------------------------------------------------- construction
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
    """Bytes of the model's parameters and buffers (tied weights once)."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


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
            storage=storage if storage.enabled and not scheduling.disable_radix_cache else None,
            events=KVEventEmitter(page_size, publisher) if publisher is not None else None,
            tp_rank=tp.rank, tp_size=tp.size, host_num_pages=host_pages,
        )
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
            part.loaded, cache, scheduling.scheduler_config(context, device.type), model_name,
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
        limit = engine.scheduler.config.max_running_requests
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
        else ("prepacked weights, one-row products over "
              + ("packed" if model.packed_from_rows == 1 else "column-major") + " weights")
        if model.packed_lm_head is not None else "plain weights",
    )


def _kv_pool_tokens(
    scheduling: SchedulingConfig, device: torch.device, bytes_per_token: int
) -> int:
    if scheduling.max_total_tokens is not None:
        return scheduling.max_total_tokens
    if device.type != "cuda":
        return CPU_KV_POOL_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * scheduling.resolved_mem_fraction_static) // bytes_per_token
