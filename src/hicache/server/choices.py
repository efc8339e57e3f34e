"""Several samples of one prompt (OpenAI's and SGLang's ``n``).

Each sample is its own engine request (``<rid>-<i>``, seed ``seed + i`` when a
seed is given, so the samples differ yet are reproducible; with disaggregation,
bootstrap room ``sample_room(room, i)``). The first starts
alone: ``start_generation`` returns once it has produced its first token, by
when its prompt is in the radix tree (write-through after prefill), so the
others, started then together, reuse the prompt's cached pages rather than
computing it n times. ``merged`` interleaves their streams as the outputs come.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from hicache.engine.api import GenerateOutput, GenerateRequest
from hicache.server.bootstrap_fields import sample_room
from hicache.server.client_watch import ClientWatch
from hicache.server.generation import Generation, start_generation
from hicache.server.protocol import PromptTokensDetails, Usage
from hicache.server.state import ServerState


def sample_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    if n == 1:
        return [request]
    out = []
    for index in range(n):
        seed = request.sampling.seed
        sampling = dataclasses.replace(
            request.sampling, seed=None if seed is None else (seed + index) % 2**63
        )
        bootstrap = request.bootstrap  # disaggregated: a room of its own (sample_room)
        if bootstrap is not None:
            bootstrap = dataclasses.replace(bootstrap, room=sample_room(bootstrap.room, index))
        # The request's own hints go with its first sample only: one outcome per hint.
        out.append(dataclasses.replace(request, rid=f"{request.rid}-{index}", sampling=sampling,
                                       bootstrap=bootstrap, hints=request.hints if index == 0
                                       else ()))
    return out


async def start_samples(
    state: ServerState, requests: Sequence[GenerateRequest], log_metrics: bool = True,
    watch: ClientWatch | None = None,
) -> list[Generation]:
    """Start the first, then (its prompt cached) the rest; if one is refused (or the
    client behind ``watch`` left), the started ones are closed and the error raised."""
    first = await start_generation(state, requests[0], log_metrics, watch)
    outcomes = await asyncio.gather(
        *(start_generation(state, r, log_metrics, watch) for r in requests[1:]),
        return_exceptions=True,
    )
    started = [first, *(o for o in outcomes if isinstance(o, Generation))]
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            for generation in started:
                await generation.aclose()
            raise outcome
    return started


async def merged(
    generations: Sequence[Generation],
) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """(index, output) of every generation as they come; closing it closes them all."""
    queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for output in generation:
                await queue.put((index, output))
        except Exception as error:  # handed to the reader
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generation in generations:
            await generation.aclose()


def usage_of_samples(outputs: Sequence[GenerateOutput], per_prompt: int | None = None) -> Usage:
    """OpenAI's usage for n samples: the prompt counted once, every completion token.

    With a batch of prompts (/v1/completions), ``outputs`` holds ``per_prompt``
    samples of each prompt in turn: each prompt is counted once, and its cached tokens."""
    per_prompt = per_prompt or len(outputs)
    firsts = outputs[::per_prompt]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.cached_tokens.total for o in firsts)),
    )
