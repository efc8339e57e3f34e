"""Engine: the model, the hierarchical cache and the scheduler thread, behind EngineProtocol.

``build_engine(args)`` turns command-line flags into a running engine;
``Engine.generate`` is what the HTTP server streams from.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import ConfigError
from hicache.engine.api import GenerateOutput, GenerateRequest, RequestError
from hicache.engine.request import Req
from hicache.engine.sampling import make_generator
from hicache.engine.scheduler import Scheduler, SchedulerConfig
from hicache.model.detokenizer import IncrementalDetokenizer
from hicache.model.identity import model_identity
from hicache.model.loader import LoadedModel, load_model, resolve_model_dir
from hicache.model.presets import DEFAULT_PRESET, PRESETS
from hicache.server.args import (
    add_cache_args,
    add_storage_args,
    cache_config_from_args,
    storage_config_from_args,
)
from hicache.storage.base import StorageError
from hicache.storage.config import load_extra_config, storage_config

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 120.0


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: HierarchicalCache,
        config: SchedulerConfig,
        model_name: str,
    ) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.cache = cache
        self.model_name = model_name
        self.vocab_size = loaded.config.vocab_size
        self.max_context_len = config.max_context_len
        self.scheduler = Scheduler(self.model, cache, config, self.tokenizer.eos_token_ids)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self.scheduler.run, args=(self._stop,), name="hicache-scheduler",
                daemon=True,
            )
            self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.cache.close()

    # ------------------------------------------------------------ requests
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def validate(self, request: GenerateRequest) -> None:
        request.sampling.validate(self.vocab_size)
        ids = request.input_ids
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids out of the vocabulary [0, {self.vocab_size}): {bad[:8]}"
            )
        if request.logprobs is not None:
            request.logprobs.validate(self.vocab_size, len(ids))
        total = len(ids) + request.sampling.max_new_tokens
        if total > self.max_context_len:
            raise RequestError(
                f"this model's context is {self.max_context_len} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {request.sampling.max_new_tokens} more "
                f"({total}): shorten the prompt or lower max_tokens"
            )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self.validate(request)
        if self._thread is None:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        rid = request.rid or uuid.uuid4().hex

        req = Req(
            request=request, rid=rid, emit=self.scheduler.outputs.emitter(loop, outputs),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.input_ids),
            generator=make_generator(request.sampling, self.cache.device_pool.device),
        )
        self.scheduler.submit(req)
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

    def flush_cache(self) -> bool:
        def flush() -> bool:
            if not self.scheduler.is_idle():
                return False
            self.cache.flush()
            return True

        return bool(self._on_scheduler(flush))

    def check_integrity(self) -> None:
        """Assert the tree and every pool are consistent and nothing leaked (when idle)."""

        def check() -> None:
            if not self.scheduler.is_idle():
                raise RuntimeError("check_integrity needs an idle engine")
            self.cache.poll(wait=True)
            self.cache.check_integrity()

        self._on_scheduler(check)

    def evict_device_cache(self) -> int:
        """Push every cached page no request holds out of L1 (host copies stay in L2).

        For benchmarks and tests that need a prefix to sit in L2 only; returns
        the number of device pages freed.
        """

        def evict() -> int:
            cache = self.cache
            cache.poll(wait=True)  # copies in flight keep their pages locked
            allocator = cache.device_pool.allocator
            before = allocator.num_free_pages
            pages = cache.alloc_device(before + cache.tree.num_evictable_device_pages)
            cache.free_device(pages)
            return allocator.num_free_pages - before

        return int(self._on_scheduler(evict))

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        config = storage_config(backend, policy, extra_config)

        def attach() -> None:
            if not self.scheduler.is_idle():
                raise StorageError("requests are running: attach L3 only when the server is idle")
            self.cache.attach_storage(config)

        self._on_scheduler(attach)

    def detach_storage(self) -> None:
        def detach() -> None:
            if not self.scheduler.is_idle():
                raise StorageError("requests are running: detach L3 only when the server is idle")
            self.cache.detach_storage()

        self._on_scheduler(detach)

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

    def metrics(self) -> dict[str, float]:
        cache, sched = self.cache, self.scheduler
        out: dict[str, float] = {f"engine_{k}": float(v) for k, v in
                                 asdict(sched.counters).items()}
        out["engine_running_requests"] = float(sched.num_running)
        out["engine_waiting_requests"] = float(sched.num_waiting)
        prompt = sched.counters.num_prompt_tokens
        cached = (sched.counters.num_cached_device_tokens + sched.counters.num_cached_host_tokens
                  + sched.counters.num_cached_storage_tokens)
        out.update({f"cache_{k}": float(v) for k, v in cache.stats.as_dict().items()})
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
        out["storage_attached"] = float(storage is not None)
        if storage is not None:
            metrics = storage.metrics()
            for key, value in asdict(metrics).items():
                if key != "failures":
                    out[f"storage_{key}"] = float(value)
            # The controller's reasons (per call) and the backend's (per page): /metrics
            # exports both as one family, told apart by a source label.
            for reason, count in metrics.failures.items():
                out[f"storage_failures_{reason}"] = float(count)
            for reason, count in storage.controller.backend_failures().items():
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
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-path", default=None,
        help="Hugging Face style model directory, or a GGUF file (llama / qwen2 / qwen3, "
        "converted once into $HICACHE_CACHE_DIR/models)",
    )
    group.add_argument(
        "--load-format", choices=["auto", "dummy"], default=None,
        help="auto: weights from --model-path; dummy: seeded random weights of a preset "
        "(default: dummy without --model-path)",
    )
    group.add_argument(
        "--model-preset", choices=sorted(PRESETS), default=None,
        help=f"architecture for --load-format dummy (default: {DEFAULT_PRESET})",
    )
    group.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    group.add_argument(
        "--device", default=None, help="cuda or cpu (default: cuda when available)"
    )
    group.add_argument(
        "--context-length", type=int, default=None,
        help="longest prompt + output (default: the model's, capped by the KV pool)",
    )
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-running-requests", type=int, default=32)
    sched.add_argument(
        "--chunked-prefill-size", type=int, default=2048,
        help="prompt tokens computed per step across requests",
    )
    sched.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="device KV pool size in tokens (default: --mem-fraction-static of free GPU "
        "memory, or 65536 on CPU)",
    )
    sched.add_argument(
        "--mem-fraction-static", type=float, default=0.85,
        help="GPU: fraction of the memory left after the weights that the KV pool takes",
    )
    sched.add_argument(
        "--disable-radix-cache", action="store_true",
        help="no prefix caching at all (a baseline for benchmarks)",
    )
    add_cache_args(parser)
    add_storage_args(parser)


def build_engine(args: argparse.Namespace) -> Engine:
    """Load the model, size the pools, attach L3, start the scheduler thread."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available")
    load_format = args.load_format or ("auto" if args.model_path else "dummy")
    preset = args.model_preset if args.model_path is None else None
    if args.model_path is not None and args.model_preset is not None:
        raise ConfigError("give either --model-path or --model-preset, not both")
    cache_config = cache_config_from_args(args)
    storage = storage_config_from_args(args)
    if args.disable_radix_cache and (cache_config.enable_hierarchical_cache or storage.enabled):
        raise ConfigError(
            "--disable-radix-cache turns prefix caching off: drop "
            "--enable-hierarchical-cache and --hicache-storage-backend with it"
        )
    if args.max_running_requests < 1 or args.chunked_prefill_size < 1:
        raise ConfigError("--max-running-requests and --chunked-prefill-size must be >= 1")
    model_dir = (
        resolve_model_dir(args.model_path, args.dtype, device) if args.model_path else None
    )
    if model_dir is not None:
        # A GGUF file is loaded, and its weights identified, through its converted dir.
        args = argparse.Namespace(**{**vars(args), "model_path": str(model_dir.path)})
    loaded = load_model(args.model_path, load_format, preset, args.dtype, device)
    if device.type == "cpu":
        # oneDNN-packed projection weights: 1.2-2.2x faster CPU decode steps (float32).
        loaded.model.prepack_weights()
    config = loaded.config
    geometry = config.kv_geometry()
    page_size = cache_config.page_size
    total_tokens = _kv_pool_tokens(args, device, geometry.bytes_per_token)
    device_pages = max(2, total_tokens // page_size)
    context = args.context_length or config.max_position_embeddings
    if args.context_length is not None and args.context_length > config.max_position_embeddings:
        raise ConfigError(
            f"--context-length {args.context_length} exceeds the model's "
            f"{config.max_position_embeddings} positions"
        )
    context = min(context, (device_pages - 1) * page_size)
    weights_name = model_dir.name if model_dir else f"dummy-{preset or DEFAULT_PRESET}"
    model_name = getattr(args, "served_model_name", None) or weights_name
    # The L3 namespace names the weights (their bytes), not the served name: servers of
    # the same weights share pages whatever they are called, other weights never do.
    cache = HierarchicalCache(
        cache_config, geometry, device_pages, device,
        model_name=model_identity(args.model_path, load_format, preset, device),
        storage=storage if storage.enabled and not args.disable_radix_cache else None,
    )
    sched = SchedulerConfig(
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_context_len=context,
        enable_prefix_cache=not args.disable_radix_cache,
    )
    logger.info(
        "engine: %s on %s, KV pool %d pages x %d tokens, context %d, L2 %s, L3 %s",
        model_name, device, device_pages, page_size, context,
        "on" if cache.hierarchical else "off",
        cache.storage.backend.name if cache.storage is not None else "off",
    )
    return Engine(loaded, cache, sched, model_name).start()


def _kv_pool_tokens(args: argparse.Namespace, device: torch.device, bytes_per_token: int) -> int:
    if args.max_total_tokens is not None:
        if args.max_total_tokens < 1:
            raise ConfigError("--max-total-tokens must be >= 1")
        return int(args.max_total_tokens)
    if device.type != "cuda":
        return 65536
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * args.mem_fraction_static) // bytes_per_token


def load_storage_extra(text: str | None) -> dict[str, Any]:
    """Re-export for the admin API: the same parsing as the flag."""
    return load_extra_config(text)
