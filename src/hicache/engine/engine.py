"""Engine: the model, the hierarchical cache and the scheduler thread, behind EngineProtocol.

``engine/build.py``'s ``build_engine(config)`` makes one from an EngineConfig
(``engine/config.py``; the server makes that from its flags);
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
from dataclasses import asdict
from typing import Any

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.engine.api import (
    GenerateOutput,
    GenerateRequest,
    Hint,
    HintOutcome,
    validate_request,
)
from hicache.engine.cache_ops import CACHE_OPS, hint_status, wait_l3_purge
from hicache.engine.config import SchedulerLimits
from hicache.engine.disaggregation import DisaggregationRuntime
from hicache.engine.grammar import Grammars
from hicache.engine.output_thread import DroppedSink, LoopSink, Stream
from hicache.engine.replication import AddRequest, ReplicatedScheduler
from hicache.engine.request import Req
from hicache.engine.sampling import make_generator
from hicache.engine.scheduler import Scheduler
from hicache.engine.thread_governor import ThreadGovernor
from hicache.engine.threads import set_thread_count
from hicache.events.publisher import ZmqEventPublisher
from hicache.memory.machine_memory import resident_bytes
from hicache.memory.sizing import PoolPlan
from hicache.model.loader import LoadedModel
from hicache.storage.base import StorageError
from hicache.storage.config import storage_config
from hicache.storage.controller import StorageMetrics
from hicache.storage.frame import PayloadOrder
from hicache.tenancy.names import tenant_label, within_tenant
from hicache.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 120.0
# How long a metrics read waits for the ranks' L3 counters (one tick, normally).
GATHER_TIMEOUT_S = 5.0
# A tenant purge: how often it looks again at pages something still held, and the least
# time its L3 pass gets even when the L1/L2 passes used up the caller's deadline.
PURGE_RETRY_S = 0.05
PURGE_MIN_L3_TIMEOUT_S = 1.0


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: HierarchicalCache,
        limits: SchedulerLimits,
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
        self.max_context_len = limits.max_context_len
        # Compiles requests' grammars where they are submitted (never on rank 0's scheduler
        # thread); a follower compiles the same specs for its own matchers.
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.scheduler = Scheduler(
            self.model, cache, limits, self.tokenizer.eos_token_ids, output_thread=output_thread,
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
        return self.scheduler.limits.chunked_prefill_size

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

    def _run_op(self, name: str, *args: Any) -> Any:
        """A cache operation (``cache_ops``), on every rank's scheduler thread."""
        if self._thread is None:
            return CACHE_OPS[name](self.scheduler, *args)
        return self.scheduler.call_op(name, *args).result(timeout=_CONTROL_TIMEOUT_S)

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

    def drain_l3_step(self) -> dict[str, Any]:
        """One step of writing every L1 and L2 page L3 lacks to L3, hottest first
        (``cache/drain.py``); the caller steps until ``done`` or its deadline."""
        return dict(self._run_op("drain_l3_step"))

    def l3_lacking_pages(self) -> int:
        """Pages in L1 or L2 that L3 lacks as far as this worker knows (0 without L3)."""
        return int(self._run_op("l3_lacking_pages"))

    def warm_start(
        self, warm_id: str, items: list[list[int]], max_host_fraction: float
    ) -> dict[str, Any]:
        """Start prefetching the prefixes ``items`` from L3 into the host tier, within
        ``max_host_fraction`` of the host pool (``cache/warm.py``); step ``warm_step``
        until ``done``, or end it with ``warm_stop``."""
        return dict(self._run_op("warm_start", warm_id, items, max_host_fraction))

    def warm_step(self, warm_id: str) -> dict[str, Any]:
        """Where the warm stands (its done prefetches settled, more started)."""
        return dict(self._run_op("warm_step", warm_id))

    def warm_stop(self, warm_id: str) -> dict[str, Any]:
        """End the warm now, keeping what landed; its final outcomes."""
        return dict(self._run_op("warm_stop", warm_id))

    def apply_hints(self, hints: list[Hint]) -> list[HintOutcome]:
        """Apply cache hints (pin, unpin, retain, prefetch, demote; ``cache/hints.py``) on
        every rank's scheduler thread; one outcome per hint, in order."""
        return list(self._run_op("hints_apply", list(hints)))

    def hint_status(self) -> dict[str, Any]:
        """What hints hold now (pinned and retained pages, budgets, outcome counts)."""
        return dict(self._on_scheduler(lambda: hint_status(self.scheduler)))

    def abort_all(self, message: str) -> int:
        """Abort every request queued or running with ``message`` as its error; returns
        how many there were. Under tensor parallelism each is aborted by rid (replicated)."""
        if self._thread is None:
            return 0
        if self.replicated is None:

            def fail_all() -> int:
                count = self.scheduler.num_running + self.scheduler.num_waiting
                self.scheduler.fail_all(message)
                return count

            return int(self.scheduler.call(fail_all).result(timeout=_CONTROL_TIMEOUT_S))
        sched = self.scheduler
        rids = sched.call(
            lambda: [req.rid for req in (*sched.running_requests(), *sched.waiting_requests())]
        ).result(timeout=_CONTROL_TIMEOUT_S)
        for rid in rids:
            self.scheduler.abort(rid)
        return len(rids)

    def purge_tenant(self, tenant: str | None, timeout_s: float) -> dict[str, Any]:
        """Remove every page of ``tenant`` from L1, L2 and L3 (``cache_ops.purge_tenant``).

        The tenant's requests, queued or running, are aborted first: a purge must not wait
        on a client that keeps a stream open, and a request served from pages being purged
        could write them back. Pages something else still holds for a moment (a copy, an
        L3 call) are purged by passes repeated until none is left or ``timeout_s`` passes
        (then they are reported as ``kept_*``); L3 is purged after them (within what is
        left of ``timeout_s``, at least ``PURGE_MIN_L3_TIMEOUT_S``), so that no backup in
        flight writes the tenant back into L3. A request of the tenant that arrives during
        the purge is served (cold) and may cache pages again.
        """
        deadline = time.monotonic() + timeout_s
        aborted = self._abort_tenant(tenant)
        totals = {"device_pages": 0, "host_pages": 0}
        result = self._run_op("purge_tenant", tenant, None)
        pause = threading.Event()  # never set: a wait that is a pause between passes
        while True:
            for key in totals:
                totals[key] += int(result[key])
            held = result["kept_device_pages"] + result["kept_host_pages"]
            if not held or time.monotonic() >= deadline:
                break
            pause.wait(PURGE_RETRY_S)
            result = self._run_op("purge_tenant", tenant, None)
        l3_timeout = max(deadline - time.monotonic(), PURGE_MIN_L3_TIMEOUT_S)
        final = self._run_op("purge_tenant", tenant, l3_timeout)
        for key in totals:
            totals[key] += int(final[key])
        l3_objects, l3_error = wait_l3_purge(
            self.cache, final, l3_timeout,
            lambda purge_id, purged: self._run_op("purge_tenant_l3_done", purge_id, purged),
        )
        return {
            **totals,
            "kept_device_pages": int(final["kept_device_pages"]),
            "kept_host_pages": int(final["kept_host_pages"]),
            "l3_objects": l3_objects,
            "l3_error": l3_error,
            "aborted_requests": aborted,
        }

    def _abort_tenant(self, tenant: str | None) -> int:
        """Abort the tenant's queued and running requests; returns how many (by rid: under
        tensor parallelism each abort is replicated)."""
        if self._thread is None:
            return 0
        sched = self.scheduler
        rids = sched.call(
            lambda: [req.rid for req in (*sched.running_requests(), *sched.waiting_requests())
                     if within_tenant(req.request.extra_key, tenant)]
        ).result(timeout=_CONTROL_TIMEOUT_S)
        for rid in rids:
            self.scheduler.abort(rid)
        return len(rids)

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

    def _tenant_bytes(self) -> dict[str, float]:
        """Bytes of each tenant's KV per tier, ``tenant_bytes_<tier>_<tenant label>``, for
        every tenant holding any (/metrics keeps the largest: ``server/tenant_metrics``).
        L1 and L2 are rank 0's tree's counts (under tensor parallelism each rank holds its
        shard of the same pages); L3 is what the store reports (nothing when it cannot tell)."""
        cache = self.cache
        tree = cache.tree
        out: dict[str, float] = {}

        def add(tier: str, tenant: str | None, num_bytes: int) -> None:
            key = f"tenant_bytes_{tier}_{tenant_label(tenant)}"
            out[key] = out.get(key, 0.0) + float(num_bytes)

        # Copies: the scheduler thread changes the counts while this runs (a dict copy
        # is one step for the interpreter).
        for tenant, pages in dict(tree.device_pages_by_tenant).items():
            add("device", tenant, pages * cache.device_pool.page_bytes)
        if cache.host_pool is not None:
            for tenant, pages in dict(tree.host_pages_by_tenant).items():
                add("host", tenant, pages * cache.host_pool.page_bytes)
        # None: the store cannot tell (or has not told yet) who holds what, so L3 has no
        # series rather than a misleading zero for every tenant.
        usage = None if cache.storage is None else cache.storage.controller.tenant_usage()
        for tenant, num_bytes in (usage or {}).items():
            add("l3", tenant, num_bytes)
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
            out["host_pool_faulted_pages"] = float(cache.host_pool.faulted_pages)
            out["host_pool_usage"] = host.num_used_pages / host.num_pages
            out["host_core_pages"] = float(cache.tree.num_core_pages)
        storage = cache.storage
        out.update(self._memory_metrics())
        out.update(self._tenant_bytes())
        # Rank 0's live costs (the ranks step together), the attached store's reads too.
        reads = {storage.backend.name: storage.read_time} if storage is not None else {}
        out.update(sched.cost_model.metrics(reads))
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
