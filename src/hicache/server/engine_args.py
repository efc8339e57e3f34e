"""The engine's command-line flags, and the EngineConfig they stand for.

``add_engine_args`` adds the model, scheduler, runtime, cache, L3 and KV events flags
(SGLang's names where SGLang has the flag); ``engine_config_from_args`` turns
the parsed flags into an EngineConfig, whose dataclasses check the values.
The engine itself never sees argparse.
"""

from __future__ import annotations

import argparse
import socket

from hicache.attention.backend import ATTENTION_BACKENDS
from hicache.disaggregation.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_TRANSFER_TIMEOUT_S,
    DisaggregationConfig,
    DisaggregationMode,
    TransferBackend,
)
from hicache.engine.config import (
    CPU_CHUNKED_PREFILL_SIZE,
    CPU_KV_POOL_TOKENS,
    CPU_PROMPT_SHARE_TOKENS,
    DEFAULT_MEM_FRACTION_STATIC,
    EngineConfig,
    ModelLoadConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerLimits,
    SchedulingConfig,
)
from hicache.model.loader import LoadFormat
from hicache.model.presets import DEFAULT_PRESET, PRESETS
from hicache.server.args import (
    add_cache_args,
    add_kv_events_args,
    add_storage_args,
    cache_config_from_args,
    kv_events_config_from_args,
    storage_config_from_args,
)

_SCHEDULING = SchedulingConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-path", default=None,
        help="Hugging Face style model directory, or a GGUF file (llama / qwen2 / qwen3, "
        "converted once into $HICACHE_CACHE_DIR/models)",
    )
    group.add_argument(
        "--load-format", choices=[f.value for f in LoadFormat], default=None,
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
    sched.add_argument(
        "--max-running-requests", type=int, default=_SCHEDULING.max_running_requests
    )
    sched.add_argument(
        "--chunked-prefill-size", type=int, default=None,
        help="prompt tokens computed per step across requests (default: "
        f"{CPU_CHUNKED_PREFILL_SIZE} on the CPU, where a step holding "
        f"{CPU_PROMPT_SHARE_TOKENS} takes no further prompt, "
        f"{SchedulerLimits.chunked_prefill_size} on a GPU; a size given here is shared "
        "by the step's prompts as given)",
    )
    sched.add_argument(
        "--max-decode-delay-ms", type=float, default=None, metavar="MS",
        help="a step with decoding requests carries only the prompt tokens that fit MS "
        "milliseconds at the measured cost of a prompt token (at least 16 tokens), so "
        "that prefill does not stretch their inter-token latency; steps without decodes "
        "keep the full chunk (default: every step takes the full --chunked-prefill-size)",
    )
    sched.add_argument(
        "--max-decode-delay-factor", type=float, default=None, metavar="F",
        help="as --max-decode-delay-ms, with the delay F times a measured decode-only "
        "step (it follows the machine's speed); with both, the smaller delay applies",
    )
    sched.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="device KV pool size in tokens (default: --mem-fraction-static of free GPU "
        f"memory; on the CPU {CPU_KV_POOL_TOKENS}, or less to fit what the machine can spare)",
    )
    sched.add_argument(
        "--mem-fraction-static", type=float, default=None,
        help="GPU: fraction of the memory left after the weights that the KV pool takes "
        f"(default: {DEFAULT_MEM_FRACTION_STATIC})",
    )
    sched.add_argument(
        "--disable-radix-cache", action="store_true",
        help="no prefix caching at all (a baseline for benchmarks)",
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int,
        default=ParallelConfig.tp_size, metavar="N",
        help="split the model over N processes (tensor parallelism; gloo on the CPU, NCCL "
        "on CUDA), each holding its shard of every layer and of the KV cache",
    )
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument(
        "--num-threads", type=int, default=None, metavar="N",
        help="torch intra-op CPU threads (OpenMP/MKL) for the engine's forwards; process-wide. "
        "Default: OMP_NUM_THREADS when set, else chosen as the engine runs: every core this "
        "process may use while other work leaves them idle, one fewer while it keeps one "
        "busy (a pool as wide as the machine stalls whenever another process takes a core)",
    )
    compute = parser.add_argument_group("compute")
    compute.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
        help="how attention reads the paged KV pool: cpu (a C++ kernel reading pages in "
        "place, built at first use), triton or flashinfer (CUDA), gather (the reference: "
        "copies each context out for SDPA); auto: flashinfer, then triton on CUDA, cpu on "
        "the CPU, falling back to gather",
    )
    compute.add_argument(
        "--disable-weight-prepack", action="store_true",
        help="CPU: multiply by the plain weights instead of oneDNN-packed copies (which "
        "cost a second copy of the projection weights' memory)",
    )
    compute.add_argument(
        "--enable-torch-compile", action="store_true",
        help="compile each layer's math around attention with torch.compile (a slower "
        "start; replaces the CPU weight prepacking)",
    )
    compute.add_argument(
        "--disable-cuda-graph", action="store_true",
        help="CUDA: run every decode step eagerly instead of replaying it from CUDA graphs "
        "recorded at start-up (one per batch-size bucket)",
    )
    compute.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, metavar="N",
        help="CUDA: the largest decode batch recorded as a graph (default: the running-"
        "request limit, at most 160); larger batches run eagerly",
    )
    compute.add_argument(
        "--disable-output-thread", action="store_true",
        help="detokenize and stream outputs on the scheduler thread after each step instead "
        "of on a thread of their own beside it",
    )
    add_cache_args(parser)
    add_storage_args(parser)
    add_kv_events_args(parser)
    add_disaggregation_args(parser)


def add_disaggregation_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's prefill-decode disaggregation flags."""
    group = parser.add_argument_group("prefill-decode disaggregation")
    group.add_argument(
        "--disaggregation-mode", choices=[m.value for m in DisaggregationMode],
        default=DisaggregationMode.NULL.value,
        help="prefill: compute prompts and send their KV to decode instances; decode: "
        "generate from KV prefill instances send; null: both (default). Requests to a "
        "prefill or decode instance need bootstrap_host, bootstrap_port and bootstrap_room "
        "(a PD router adds them)",
    )
    group.add_argument(
        "--disaggregation-transfer-backend", choices=[b.value for b in TransferBackend],
        default=TransferBackend.MOONCAKE.value,
        help="how KV moves between instances (the Mooncake TransferEngine; TCP here)",
    )
    group.add_argument(
        "--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
        metavar="PORT",
        help="prefill: the port of the bootstrap server decode instances register their "
        "requests' pages with (default: %(default)s)",
    )
    group.add_argument(
        "--disaggregation-transfer-timeout-s", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S,
        metavar="S",
        help="a request whose KV has not been handed over in S seconds fails, on both sides "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--disaggregation-decode-enable-offload-kvcache", action="store_true",
        help="decode: a finished request's KV (prompt and output) goes to the cache tree and "
        "from there to L2 and L3, so the next turn's prefill finds it in a shared L3",
    )


def disaggregation_config_from_args(args: argparse.Namespace) -> DisaggregationConfig:
    if not hasattr(args, "disaggregation_mode"):  # a parser without the flags
        return DisaggregationConfig()
    host = getattr(args, "host", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        # Peers need an address to reach: this machine's name, resolved.
        host = socket.gethostbyname(socket.gethostname())
    return DisaggregationConfig(
        mode=DisaggregationMode(args.disaggregation_mode),
        transfer_backend=TransferBackend(args.disaggregation_transfer_backend),
        bootstrap_port=args.disaggregation_bootstrap_port,
        host=host,
        transfer_timeout_s=args.disaggregation_transfer_timeout_s,
        decode_offload_kvcache=args.disaggregation_decode_enable_offload_kvcache,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; ConfigError messages name the flag to change.

    ``--served-model-name`` is read when the parser has it (serve adds it).
    """
    return EngineConfig(
        model=ModelLoadConfig(
            model_path=args.model_path,
            load_format=args.load_format,
            preset=args.model_preset,
            dtype=args.dtype,
            device=args.device,
            context_length=args.context_length,
            served_model_name=getattr(args, "served_model_name", None),
        ),
        scheduling=SchedulingConfig(
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            max_decode_delay_ms=args.max_decode_delay_ms,
            max_decode_delay_factor=args.max_decode_delay_factor,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            disable_radix_cache=args.disable_radix_cache,
        ),
        cache=cache_config_from_args(args),
        storage=storage_config_from_args(args),
        events=kv_events_config_from_args(args),
        runtime=RuntimeConfig(
            num_threads=args.num_threads, attention_backend=args.attention_backend,
            prepack_weights=not args.disable_weight_prepack,
            enable_torch_compile=args.enable_torch_compile,
            output_thread=not args.disable_output_thread,
            cuda_graph=not args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        ),
        parallel=ParallelConfig(tp_size=args.tp_size),
        disaggregation=disaggregation_config_from_args(args),
    )
