"""Closed-loop multi-turn conversations against a server, in a thread of their own, for a
time rather than a count.

``ConversationLoad`` keeps ``conversations`` conversations going (each round the
whole conversation so far, the answer and a new question, as ``hicache bench
multiturn`` sends them) with at most ``in_flight`` requests under way, until
``stop()``. A conversation that reached ``max_rounds`` rounds, or whose request
failed (its history has no answer to go on with), starts over as a new one with
prompts of its own. Every request is recorded with the phase the caller had set
when it was sent (``load.phase = "after"``), so the caller cuts the run into windows
while the traffic keeps going.

Invariants: the prompts depend only on the seed and the conversation's number, never
on timing; ``stop()`` sends nothing more and returns once every request under way
has ended (each recorded); a record's phase is the one set at its send.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np

from hicache.bench.client import ApiStyle, BenchClient
from hicache.bench.report import RequestRecord
from hicache.bench.workload import PromptMaker, Session, WorkloadError


@dataclass(frozen=True)
class ConversationShape:
    """The sizes of each conversation, in tokens."""

    first_prompt_tokens: int
    round_tokens: int  # the new question each later round adds after the answer
    output_tokens: int
    max_rounds: int  # then the conversation starts over as a new one

    def __post_init__(self) -> None:
        if self.first_prompt_tokens < 1 or self.output_tokens < 1 or self.max_rounds < 1:
            raise WorkloadError(
                "first prompt tokens, output tokens and rounds must be >= 1")
        if self.round_tokens < 0:
            raise WorkloadError("round tokens must be >= 0")

    @property
    def longest_tokens(self) -> int:
        """The last round's prompt and answer: the most a conversation's request needs."""
        return self.first_prompt_tokens + (self.max_rounds - 1) * (
            self.output_tokens + self.round_tokens) + self.output_tokens

    def check_fits(self, context_tokens: int, flag: str) -> None:
        """WorkloadError unless the longest request fits ``context_tokens`` (a worker's
        device pool, which also bounds its context)."""
        if self.longest_tokens > context_tokens:
            raise WorkloadError(
                f"a conversation's last round needs {self.longest_tokens} tokens (prompt and "
                f"answer), more than {flag} {context_tokens}: fewer rounds or shorter prompts")

    def session(self, number: int, maker: PromptMaker, seed: int) -> Session:
        """Conversation ``number``: its own random stream, so it shares no prefix."""
        rng = np.random.default_rng([seed, number])
        parts = [maker.make(rng, self.first_prompt_tokens)]
        parts += [maker.make(rng, self.round_tokens) for _ in range(self.max_rounds - 1)]
        return Session(number, parts, self.output_tokens, maker)


@dataclass(frozen=True)
class PhasedRecord:
    phase: str
    record: RequestRecord


class ConversationLoad:
    """See the module docstring."""

    def __init__(
        self, url: str, shape: ConversationShape, conversations: int, in_flight: int,
        maker: PromptMaker, *, seed: int = 0, timeout_s: float = 600.0,
        phase: str = "start",
    ) -> None:
        if conversations < 1 or in_flight < 1:
            raise WorkloadError("conversations and requests in flight must be >= 1")
        self.url = url
        self.shape = shape
        self.conversations = conversations
        self.in_flight = in_flight
        self.maker = maker
        self.seed = seed
        self.timeout_s = timeout_s
        self.phase = phase  # a plain attribute: one writer, and a str swap is atomic
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._records: list[PhasedRecord] = []
        self._thread: threading.Thread | None = None
        self._crash: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("this load was started already")
        self._thread = threading.Thread(target=self._main, name="conversations", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Send nothing more; wait for the requests under way (at most ``timeout_s``,
        None: the request timeout and a margin). Raises what crashed the load, if anything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 30 if timeout_s is None else timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("the conversations did not stop in time")
        if self._crash is not None:
            raise RuntimeError(f"the conversations crashed: {self._crash!r}") from self._crash

    def records(self) -> list[PhasedRecord]:
        with self._lock:
            return list(self._records)

    def answered(self) -> int:
        with self._lock:
            return len(self._records)

    # ---------------------------------------------------------------- the thread
    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as error:  # reported by stop()
            self._crash = error

    async def _run(self) -> None:
        client = BenchClient(self.url, ApiStyle.GENERATE, timeout_s=self.timeout_s,
                             max_connections=self.in_flight)
        slots = asyncio.Semaphore(self.in_flight)
        start = time.perf_counter()
        async with client:
            await asyncio.gather(*(self._converse(client, slots, start, first)
                                   for first in range(self.conversations)))

    async def _converse(
        self, client: BenchClient, slots: asyncio.Semaphore, start: float, number: int,
    ) -> None:
        """One conversation slot: conversation ``number``, then ``number + conversations``,
        ... until stopped."""
        while not self._stop.is_set():
            session = self.shape.session(number, self.maker, self.seed)
            while not session.done and not self._stop.is_set():
                plan = session.next_request()
                async with slots:
                    if self._stop.is_set():
                        return
                    phase = self.phase
                    result = await client.send(plan.prompt, plan.max_tokens)
                record = RequestRecord.of(number, plan.round, 0, result, start,
                                          self.maker.count(plan.prompt))
                with self._lock:
                    self._records.append(PhasedRecord(phase, record))
                if not result.ok:
                    break  # no answer to build the next round on: a new conversation
                session.record_answer(result.text, result.output_ids)
            number += self.conversations
