"""The ``hicache`` command: the server, the router, the demo and the benchmarks.

Each command imports its own modules only: ``serve`` and ``router`` never import
``hicache.bench`` nor the bench extra's packages (tests/e2e/test_import_graph.py).
A benchmark's module is imported when that benchmark is chosen, not before:
``hicache bench --help`` lists the table below without importing any of them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

# What the [bench] extra installs: benchmarks import them, the server never does.
BENCH_EXTRA_MODULES = ("aiohttp", "tqdm", "matplotlib")
BENCH_EXTRA_HINT = "pip install 'hicache[bench]'"

# Each benchmark's module exposes add_arguments(parser) and main(args) -> int, and may
# pull in heavy or optional dependencies: it is imported only once chosen.
_BENCHMARKS: dict[str, tuple[str, str]] = {
    "transfer": ("hicache.bench.transfer", "L2<->L1 page transfer bandwidth per layout/io backend"),
    "attention": ("hicache.bench.attention", "attention backends side by side on a paged pool"),
    "decode": ("hicache.bench.decode", "model decode steps per batch size, per compute setting"),
    "forward": ("hicache.bench.forward_profile", "the model's forward for a cold prompt and "
                "decode steps: time, GEMM GFLOP/s, share per op kind"),
    "step": ("hicache.bench.step", "scheduler host time per decode step, model forward excluded"),
    "sampling": ("hicache.bench.sampling", "one step's sampling, batched against row by row"),
    "grammar": ("hicache.bench.grammar", "grammar masks' cost per decode step; valid answers "
                "of a server with tool_choice required and a json_schema"),
    "tree": ("hicache.bench.tree", "radix tree insert / match / evict latency"),
    "storage": ("hicache.bench.storage", "L3 backend batch put/get throughput vs plain baseline"),
    "page-hash": ("hicache.bench.page_hash", "L3 page checksums in place and gathered: rate, "
                  "and a scheduler-like thread's pace beside them (the GIL)"),
    "prefill": ("hicache.bench.prefill", "cold prefill throughput against HF transformers"),
    "multiturn": ("hicache.bench.multiturn", "multi-round conversations against a server"),
    "long-context": ("hicache.bench.long_context", "questions over long shared contexts"),
    "cold-engine": ("hicache.bench.cold_engine", "cold prompts through an engine built as "
                    "hicache serve builds it, in process: time, TTFT, CPU per thread"),
    "compare": ("hicache.bench.compare", "the same workload against each cache configuration"),
    "plot": ("hicache.bench.plots", "plot run summaries (PNG) side by side"),
    "router-decision": (
        "hicache.bench.router_decision", "a routing decision's cost: 8 workers, 1M indexed pages"
    ),
    "mixed-tpot": ("hicache.bench.mixed_tpot", "decodes' TPOT while long prompts prefill "
                   "beside them, per --max-decode-delay-ms"),
    "l2-ttft": ("hicache.bench.l2_ttft", "TTFT of a full L2 prefix hit next to its physical bound"),
    "load-vs-recompute": ("hicache.bench.load_vs_recompute", "TTFT of a full L3 (throttled) "
                          "or L2 hit against recomputing the prompt, with the cost model's "
                          "predictions"),
    "router": ("hicache.bench.router_bench", "multi-turn conversations over a cluster, per "
               "router policy"),
    "pd": ("hicache.bench.pd_bench", "multi-turn conversations on one instance and on a "
           "prefill-decode pair: TTFT and ITL side by side"),
    "rolling-restart": ("hicache.bench.rolling_restart", "a rolling restart of every worker "
                        "behind the router under traffic: failed requests, cache served "
                        "before and after"),
    "agent-retain": ("hicache.bench.agent_retain", "agent sessions pausing past the host "
                     "tier: cached tokens on resume with and without retain hints"),
}

_COMMANDS = ("serve", "router", "demo", "bench")


class BenchExtraMissing(RuntimeError):
    """A benchmark needs a package of the [bench] extra that is not installed."""


def import_benchmark(module_name: str) -> ModuleType:
    """The benchmark's module; BenchExtraMissing when it needs what the extra installs."""
    with _bench_extra_required():
        return importlib.import_module(module_name)


@contextlib.contextmanager
def _bench_extra_required() -> Iterator[None]:
    """Turns a missing package of the bench extra into BenchExtraMissing, with the hint."""
    try:
        yield
    except ModuleNotFoundError as error:
        package = (error.name or "").split(".")[0]
        if package not in BENCH_EXTRA_MODULES:
            raise
        raise BenchExtraMissing(
            f"this benchmark needs {package}, which the bench extra installs: "
            f"{BENCH_EXTRA_HINT}"
        ) from error


if TYPE_CHECKING:
    _SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    _SubParsers = argparse._SubParsersAction


class _LazyBenchmarkParsers(_SubParsers):
    """``hicache bench``'s subcommands: a benchmark's arguments are added to its parser
    (its module imported) only when the command line chooses it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: str | Sequence[Any] | None, option_string: str | None = None,
    ) -> None:
        name = values[0] if isinstance(values, list) and values else None
        chosen = self._name_parser_map.get(name) if isinstance(name, str) else None
        if chosen is not None and not chosen.get_default("_loaded"):
            try:
                module = import_benchmark(chosen.get_default("_module"))
            except BenchExtraMissing as error:
                chosen.error(str(error))
            module.add_arguments(chosen)
            chosen.set_defaults(_loaded=True)
        super().__call__(parser, namespace, values, option_string)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with ``only``, the other commands are named (for --help)
    but their arguments, and the modules defining them, are not loaded: ``hicache
    router`` must not import the server's engine and torch with it (see
    tests/e2e/test_router_imports.py). A benchmark's arguments load only when chosen."""
    parser = argparse.ArgumentParser(prog="hicache", description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--log-level", default=None, help="python logging level (default: info for serve, "
        "warning otherwise)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with the L1/L2/L3 KV cache",
        description="Serve a model over HTTP (OpenAI and SGLang-style APIs).",
    )
    if only in (None, "serve"):
        from hicache.server.serve import add_arguments as add_serve_arguments

        add_serve_arguments(serve)

    router = sub.add_parser(
        "router", help="route requests over several workers by where their prefix is cached",
        description="Proxy OpenAI and SGLang-style requests to workers, choosing each one "
        "from the KV events the workers publish.",
    )
    if only in (None, "router"):
        from hicache.router.settings import add_arguments as add_router_arguments

        add_router_arguments(router)

    demo = sub.add_parser("demo", help="fill L1, spill to L2, load back, and show what happened")
    if only in (None, "demo"):
        from hicache.demo import add_arguments as add_demo_arguments

        add_demo_arguments(demo)

    bench = sub.add_parser("bench", help="micro-benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, action=_LazyBenchmarkParsers)
    for name, (module_name, help_text) in _BENCHMARKS.items():
        bench_parser = bench_sub.add_parser(name, help=help_text)
        bench_parser.set_defaults(_module=module_name, _loaded=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is no option nor --log-level's
    value), or None when it names none this program has: then every parser is built."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(only=_command(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    level = args.log_level or ("info" if args.command in ("serve", "router") else "warning")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        from hicache.server.serve import main as serve_main

        return serve_main(args)
    if args.command == "router":
        from hicache.router.serve import main as router_main

        return router_main(args)
    if args.command == "demo":
        from hicache.demo import main as demo_main

        return demo_main(args)
    if args.command == "bench":
        module = import_benchmark(args._module)
        try:
            with _bench_extra_required():
                return int(module.main(args))
        except BenchExtraMissing as error:
            # A module some benchmarks import only when they need it (plots: matplotlib).
            print(f"hicache bench {args.bench}: {error}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
