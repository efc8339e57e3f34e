"""Multi-turn conversations played closed-loop or open-loop, bounded in count and time.

``hicache bench router --sweep`` drives each router with one of two load models:

- Closed loop: every conversation sends its turns one after another (a turn once the
  previous answer is back), at most ``max_inflight`` requests in flight over all of them,
  handed out first come, first served: a conversation whose answer came back queues
  behind those already waiting, as in ``hicache bench multiturn``.
- Open loop (``rate`` requests per second): the arrival times of one Poisson process of
  that rate, ``t_k`` = the sum of ``k + 1`` exponential gaps of mean ``1 / rate`` (seeded,
  so every router sees the same schedule). Arrival ``k`` is turn ``k // N`` of
  conversation ``k % N`` (N conversations): the turns go out in the closed loop's order
  (every first turn, then every second one, ...), a conversation's turns N arrivals apart
  on average. A turn is sent at the later of its arrival and the previous turn's answer:
  a conversation never has two turns in flight, and a slow answer delays only its own
  conversation's next turn (the others keep their arrival times). Nothing else caps the
  requests in flight (at most N).

With ``live`` set, the sessions play as ``live`` chains, at most that many conversations
at once: chain ``c`` plays sessions ``c``, ``c + live``, ``c + 2 live``, ... one after
another, a new conversation (fresh text) starting once the one before it has answered its
last turn. The conversations alive at once then stay the working set a point asks for
while a run sends as many turns as its time allows; finished ones are never asked again,
so their cached pages only age. Each load model treats a chain as one conversation of all
its sessions' turns (the Poisson schedule's ``N`` is the number of chains).

Both stop by themselves: a turn that would be sent more than ``deadline_s`` after the
start is not sent, nor any later turn of its conversation; the run ends once the requests
in flight have answered. So a run sends at most every conversation's every turn, and
issues nothing after the deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.bench.client import ApiStyle, BenchClient
from hicache.bench.multiturn import BenchmarkError
from hicache.bench.report import JsonlLog, RequestRecord, RunSummary
from hicache.bench.workload import PromptMaker, Session, WorkloadError, warmup_prompts

# The arrival stream's seed is [seed, this]: apart from the prompts' streams.
_SCHEDULE_STREAM = 7_3


def schedule_span(num_conversations: int, num_rounds: int, rate: float, seed: int) -> float:
    """Seconds after the start when the last turn of ``poisson_schedule(...)`` arrives: a
    run whose deadline is this long sends every turn of every conversation."""
    schedule = poisson_schedule(num_conversations, num_rounds, rate, seed)
    return max(max(turns) for turns in schedule)


def poisson_schedule(
    num_conversations: int, num_rounds: int, rate: float, seed: int
) -> list[list[float]]:
    """``schedule[c][r]``: seconds after the start when turn ``r`` of conversation ``c``
    arrives (the module docstring's model)."""
    if not (rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"an open-loop rate must be a positive number, got {rate}")
    if num_conversations < 1 or num_rounds < 1:
        raise WorkloadError("an open-loop schedule needs at least one conversation and round")
    rng = np.random.default_rng([seed, _SCHEDULE_STREAM])
    times = np.cumsum(rng.exponential(1.0 / rate, size=num_conversations * num_rounds))
    return [
        [float(times[r * num_conversations + c]) for r in range(num_rounds)]
        for c in range(num_conversations)
    ]


@dataclass(frozen=True)
class LoadSpec:
    """How one run's conversations are sent."""

    deadline_s: float  # no turn is sent later than this after the start
    max_inflight: int = 0  # closed loop's cap; 0: none
    rate: float | None = None  # open loop's arrivals per second; None: closed loop
    seed: int = 0
    live: int = 0  # conversations alive at once (chains of sessions); 0: every session

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise WorkloadError(f"a run's deadline must be > 0 s, got {self.deadline_s}")
        if self.max_inflight < 0:
            raise WorkloadError("max_inflight must be >= 0")
        if self.live < 0:
            raise WorkloadError("live must be >= 0")


def chains(sessions: Sequence[Session], live: int) -> list[list[Session]]:
    """The sessions as ``live`` chains played one after another (0: one chain each)."""
    width = len(sessions) if live == 0 else min(live, len(sessions))
    return [list(sessions[c::width]) for c in range(width)] if sessions else []


async def play(
    client: BenchClient, sessions: Sequence[Session], maker: PromptMaker, spec: LoadSpec,
    log: JsonlLog | None = None,
) -> list[RequestRecord]:
    """Send the sessions' turns as ``spec`` says; one record per request sent."""
    chained = chains(sessions, spec.live)
    turns = max((sum(s.num_rounds for s in chain) for chain in chained), default=0)
    schedule = (
        poisson_schedule(len(chained), turns, spec.rate, spec.seed)
        if spec.rate is not None and chained else None
    )
    slots = asyncio.Semaphore(spec.max_inflight) if spec.max_inflight else None
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def conversation(index: int, chain: Sequence[Session]) -> None:
        turn = 0
        for session in chain:
            if not await play_session(index, session, turn):
                return
            turn += session.num_rounds

    async def play_session(index: int, session: Session, turn: int) -> bool:
        """The session's turns from the chain's ``turn``; False once the deadline stops it."""
        while not session.done:
            if schedule is not None:
                arrival = schedule[index][turn]
                if arrival > spec.deadline_s:
                    return False
                delay = start + arrival - time.perf_counter()
                while delay > 0:  # again if the loop woke early: never send before arrival
                    await asyncio.sleep(delay)
                    delay = start + arrival - time.perf_counter()
            if slots is not None:
                await slots.acquire()
            try:
                if time.perf_counter() - start > spec.deadline_s:
                    return False
                plan = session.next_request()
                result = await client.send(plan.prompt, plan.max_tokens)
            finally:
                if slots is not None:
                    slots.release()
            record = RequestRecord.of(
                plan.session, plan.round, plan.group, result, start, maker.count(plan.prompt)
            )
            records.append(record)
            if log is not None:
                log.write(record)
            session.record_answer(result.text, result.output_ids)
            turn += 1
        return True

    await asyncio.gather(*(conversation(i, chain) for i, chain in enumerate(chained)))
    records.sort(key=lambda r: r.sent_s)
    return records


async def run_load(
    url: str, sessions: Sequence[Session], maker: PromptMaker, spec: LoadSpec, label: str,
    *, api: ApiStyle = ApiStyle.GENERATE, model: str | None = None, warmup: int = 1,
    request_timeout_s: float = 600.0, log_file: str | None = None,
    config: dict[str, Any] | None = None,
) -> RunSummary:
    """Warm up with short unrelated requests (not counted), then ``play``; the summary."""
    connections = spec.max_inflight or max(1, len(chains(sessions, spec.live)))
    client = BenchClient(
        url, api, model=model, temperature=0.0, ignore_eos=True, timeout_s=request_timeout_s,
        max_connections=connections,
    )
    async with client:
        if sessions:
            length = max(1, min(64, min(maker.count(s.parts[0]) for s in sessions)))
            for prompt in warmup_prompts(maker, warmup, length, spec.seed):
                result = await client.send(prompt, 1)
                if not result.ok:
                    raise BenchmarkError(f"warm-up request to {url} failed: {result.error}")
        with JsonlLog(log_file) as log:
            records = await play(client, sessions, maker, spec, log)
    return RunSummary.of(label, records, config)
