"""``hicache bench long-context``: many questions over a few long shared documents.

Every request is a long context followed by a short question, so all questions
about one document share its prefix: the first pays for the whole document,
the others should find it cached. With ``--dataset`` the documents and
questions come from a LooGLE-style JSON file (see ``workload.load_long_context``);
otherwise ``--num-contexts`` random documents of ``--context-length`` tokens get
``--questions-per-context`` random questions each. Questions go round-robin over
the documents by default, so a device pool too small for all of them must swap
them between tiers; ``--shuffle`` sends them in a seeded random order instead.
Per-round figures in the report are the whole run here (every request is round 0).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hicache.bench.multiturn import (
    BenchmarkError,
    add_client_arguments,
    args_config,
    finish,
    prompt_maker,
    run_benchmark,
    server_url,
)
from hicache.bench.workload import (
    LongContextDataset,
    PromptMaker,
    Session,
    WorkloadError,
    load_long_context,
    synthetic_long_context,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    add_long_context_arguments(parser)


def add_long_context_arguments(
    parser: argparse.ArgumentParser, *, output_length: bool = True
) -> None:
    """The workload flags; ``output_length=False`` where another group defines it."""
    group = parser.add_argument_group("long-context workload")
    group.add_argument(
        "--dataset", default=None,
        help="LooGLE-style JSON ({contexts, queries} or LooGLE records); default: synthetic",
    )
    group.add_argument("--num-contexts", type=int, default=4, help="synthetic documents")
    group.add_argument(
        "--context-length", type=int, default=8192, help="tokens per synthetic document"
    )
    group.add_argument("--questions-per-context", type=int, default=16)
    group.add_argument("--question-length", type=int, default=64, help="tokens per question")
    if output_length:
        group.add_argument(
            "--output-length", type=int, default=32,
            help="tokens per answer (a dataset's reference answers set their own length)",
        )
    group.add_argument(
        "--num-questions", type=int, default=None, help="send only the first N questions"
    )
    group.add_argument(
        "--shuffle", action="store_true",
        help="seeded random question order instead of round-robin over the documents",
    )


def long_context_dataset(args: argparse.Namespace, maker: PromptMaker) -> LongContextDataset:
    if args.dataset:
        return load_long_context(args.dataset, maker)
    return synthetic_long_context(
        args.num_contexts, args.context_length, args.questions_per_context,
        args.question_length, maker, args.seed,
    )


def long_context_workload(args: argparse.Namespace, maker: PromptMaker) -> list[Session]:
    if args.output_length < 1:
        raise WorkloadError("--output-length must be >= 1")
    dataset = long_context_dataset(args, maker)
    sessions = dataset.sessions(
        maker, args.output_length, interleave=not args.shuffle, num_queries=args.num_questions,
        seed=args.seed,
    )
    if not sessions:
        raise WorkloadError("no questions to send")
    return sessions


def main(args: argparse.Namespace) -> int:
    try:
        maker = prompt_maker(args)
        sessions = long_context_workload(args, maker)
        config = args_config(args)
        label = args.label or f"long-context-{args.api}"
        summary = asyncio.run(run_benchmark(args, sessions, maker, server_url(args), label, config))
    except (WorkloadError, BenchmarkError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return finish(summary, args)
