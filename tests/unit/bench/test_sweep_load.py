"""The sweep's load models: the seeded Poisson schedule of turns, and the player against a
stand-in client (no server)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from hicache.bench.client import RequestResult
from hicache.bench.sweep_load import LoadSpec, play, poisson_schedule
from hicache.bench.workload import (
    Prompt,
    PromptMaker,
    PromptStyle,
    WorkloadError,
    load_codec,
    multiturn_sessions,
)


def test_the_schedule_is_seeded_and_deterministic() -> None:
    a = poisson_schedule(4, 3, 2.0, seed=1)
    assert a == poisson_schedule(4, 3, 2.0, seed=1)
    assert a != poisson_schedule(4, 3, 2.0, seed=2)
    assert len(a) == 4 and all(len(turns) == 3 for turns in a)


def test_arrival_k_is_turn_k_div_n_of_conversation_k_mod_n() -> None:
    schedule = poisson_schedule(5, 4, 3.0, seed=0)
    flat = [schedule[k % 5][k // 5] for k in range(20)]
    assert flat == sorted(flat) and len(set(flat)) == 20
    assert all(t > 0 for t in flat)


def test_the_arrival_rate_is_the_asked_one() -> None:
    rate, n = 4.0, 4000
    schedule = poisson_schedule(40, n // 40, rate, seed=3)
    times = sorted(t for turns in schedule for t in turns)
    measured = n / times[-1]
    # The mean of 4,000 exponential gaps is within 5% of 1/rate (about 3 standard errors).
    assert measured == pytest.approx(rate, rel=0.05)
    gaps = np.diff([0.0, *times])
    # Exponential gaps: their standard deviation is their mean.
    assert float(np.std(gaps)) == pytest.approx(float(np.mean(gaps)), rel=0.1)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_a_rate_must_be_a_positive_number(rate: float) -> None:
    with pytest.raises(WorkloadError):
        poisson_schedule(2, 2, rate, seed=0)


class StandInClient:
    """Answers every request after ``delay_s``; counts the requests in flight."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.in_flight = 0
        self.most_in_flight = 0
        self.sent: list[Prompt] = []

    async def send(self, prompt: Prompt, max_tokens: int) -> RequestResult:
        self.sent.append(prompt)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        sent_at = time.perf_counter()
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return RequestResult(ok=True, sent_at=sent_at, latency_s=self.delay_s, ttft_s=0.0,
                             prompt_tokens=None, output_tokens=max_tokens, text="x" * max_tokens)


def _maker() -> PromptMaker:
    return PromptMaker(PromptStyle.TOKENS, load_codec(None), 0, 256)


def _sessions(maker: PromptMaker, clients: int = 5, rounds: int = 4) -> Sequence[Any]:
    return multiturn_sessions(clients, rounds, 16, 4, 2, maker, 0)


def test_the_closed_loop_sends_every_turn_with_at_most_max_inflight() -> None:
    maker = _maker()
    client = StandInClient(delay_s=0.005)
    records = asyncio.run(play(client, _sessions(maker), maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=600.0, max_inflight=2)))
    assert len(records) == 5 * 4 and all(r.ok for r in records)
    assert client.most_in_flight == 2
    # Every conversation's turns in order, one after another.
    for session in range(5):
        assert [r.round for r in records if r.session == session] == [0, 1, 2, 3]


def test_the_open_loop_sends_no_turn_scheduled_past_the_deadline() -> None:
    maker = _maker()
    client = StandInClient()
    rate = 400.0
    schedule = poisson_schedule(5, 4, rate, seed=0)
    deadline = sorted(t for turns in schedule for t in turns)[9]  # the 10th arrival
    records = asyncio.run(play(client, _sessions(maker), maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=deadline, rate=rate)))
    # At most the ten arrivals by the deadline; a conversation stops at its first turn
    # past it (a busy machine may push a send past it too, never past a later arrival).
    assert 1 <= len(records) <= 10
    for record in records:
        assert schedule[record.session][record.round] <= deadline
        # Nothing is sent before its arrival.
        assert record.sent_s >= schedule[record.session][record.round] - 1e-3


def test_the_open_loop_without_a_deadline_sends_everything_once_per_turn() -> None:
    maker = _maker()
    client = StandInClient(delay_s=0.001)
    records = asyncio.run(play(client, _sessions(maker, 3, 3), maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=600.0, rate=500.0, seed=4)))
    assert sorted((r.session, r.round) for r in records) == [
        (s, r) for s in range(3) for r in range(3)]
    assert client.most_in_flight <= 3  # one turn in flight per conversation at most


def test_a_load_spec_is_checked() -> None:
    with pytest.raises(WorkloadError):
        LoadSpec(deadline_s=0.0)
    with pytest.raises(WorkloadError):
        LoadSpec(deadline_s=1.0, max_inflight=-1)


def test_live_chains_keep_that_many_conversations_alive_and_play_them_in_turn() -> None:
    maker = _maker()
    client = StandInClient(delay_s=0.002)
    sessions = _sessions(maker, clients=6, rounds=2)  # 2 alive, 3 generations each
    records = asyncio.run(play(client, sessions, maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=600.0, max_inflight=4, live=2)))
    assert len(records) == 6 * 2 and all(r.ok for r in records)
    # Two chains: each request's conversation is alive only between its chain
    # predecessor's last answer and its own; at most one turn of a chain in flight.
    assert client.most_in_flight == 2
    for chain in ([0, 2, 4], [1, 3, 5]):
        mine = [r for r in records if r.session in chain]
        assert [(r.session, r.round) for r in mine] == [(s, t) for s in chain for t in (0, 1)]
        for earlier, later in itertools.pairwise(mine):
            assert later.sent_s >= earlier.sent_s + earlier.latency_s - 1e-3


def test_an_open_loop_over_chains_schedules_each_chain_as_one_conversation() -> None:
    maker = _maker()
    client = StandInClient(delay_s=0.001)
    rate = 300.0
    records = asyncio.run(play(client, _sessions(maker, clients=4, rounds=2), maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=600.0, rate=rate, seed=5, live=2)))
    assert len(records) == 8
    schedule = poisson_schedule(2, 4, rate, seed=5)  # 2 chains of 2 sessions x 2 rounds
    for record in records:
        chain, generation = record.session % 2, record.session // 2
        arrival = schedule[chain][generation * 2 + record.round]
        assert record.sent_s >= arrival - 1e-3


def test_a_chain_stops_at_the_deadline_with_its_later_conversations() -> None:
    maker = _maker()
    client = StandInClient(delay_s=0.4)
    # A closed loop whose deadline passes during the first answers: no second turn, and
    # none of the chains' later conversations start.
    records = asyncio.run(play(client, _sessions(maker, clients=6, rounds=3), maker,  # type: ignore[arg-type]
                               LoadSpec(deadline_s=0.2, max_inflight=3, live=3)))
    assert records and all(r.session in (0, 1, 2) and r.round == 0 for r in records)
    with pytest.raises(WorkloadError):
        LoadSpec(deadline_s=1.0, live=-1)
