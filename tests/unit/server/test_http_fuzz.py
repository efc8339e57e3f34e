"""A real ``hicache serve`` under a seeded fuzz of hostile requests stays up and answers.

A few hundred cases from tests/http_fuzz.py (malformed JSON, wrong types,
extreme numbers, empty and megabyte prompts, special-token floods, bad
messages, unknown fields, streaming and not) go to /generate,
/v1/completions and /v1/chat/completions from a few concurrent clients, while
a poller asks /health every 100 ms. Every answer must be a 2xx (a complete
stream ending in [DONE] without an error event, or a JSON body) or a 4xx with
an error body: never a 5xx, a dropped connection or no answer. /health must
answer within 1 s throughout. Afterwards an ordinary request still works, the
engine is idle, /metrics parses, and the server logged no traceback.

Bounded: a fixed number of cases, short generations, a deadline after which no
case starts, per-request timeouts, and a server that is killed if it does not
stop. Everything is on loopback.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.server_process import ServerProcess
from tests.http_fuzz import FuzzCase, fuzz_cases

SEED = 1729
NUM_CASES = 300
NUM_CLIENTS = 4
# A small pool and a short context: every accepted case is cheap to serve.
SERVE_FLAGS = ["--device", "cpu", "--max-total-tokens", "1024", "--context-length", "256"]
START_TIMEOUT_S = 90.0  # a cold interpreter imports torch first
REQUEST_TIMEOUT_S = 30.0
FUZZ_DEADLINE_S = 120.0  # no case starts later than this after the first
HEALTH_PERIOD_S = 0.1
HEALTH_LIMIT_S = 1.0
IDLE_TIMEOUT_S = 15.0
JSON_HEADERS = {"Content-Type": "application/json"}
SHOWN_PER_KIND = 4  # example requests listed per kind of failure


@dataclass
class Outcome:
    case: FuzzCase
    status: int | None = None
    problem: str | None = None  # None: an acceptable answer


@dataclass
class HealthWatch:
    """Asks /health every HEALTH_PERIOD_S from its own thread; records slow or failed answers."""

    url: str
    stalls: list[str] = field(default_factory=list)
    num_polls: int = 0
    worst_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        started = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=HEALTH_LIMIT_S) as client:
            while not self._stop.wait(HEALTH_PERIOD_S):
                asked = time.monotonic()
                try:
                    response = client.get("/health")
                    problem = None if response.status_code == 200 else \
                        f"status {response.status_code}"
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}"
                took_s = time.monotonic() - asked
                self.num_polls += 1
                self.worst_s = max(self.worst_s, took_s)
                if problem is None and took_s >= HEALTH_LIMIT_S:
                    problem = f"answered after {took_s:.2f} s"
                if problem is not None:
                    self.stalls.append(f"at {asked - started:.1f} s: {problem}")

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")}
    with ServerProcess(
        SERVE_FLAGS, tmp_path / "serve.log", env=env, startup_timeout_s=START_TIMEOUT_S,
        stop_timeout_s=15.0,
    ) as running:
        yield running


def judge(response: httpx.Response) -> str | None:
    """What is wrong with an answer (its body already read), or None."""
    status = response.status_code
    text = response.text
    if 400 <= status < 500:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an error body: {text[:200]!r}"
        return None if isinstance(message, str) and message else f"{status}: empty message"
    if not 200 <= status < 300:
        return f"status {status}: {text[:300]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {text[-200:]!r}"
        for payload in events[:-1]:
            parsed = json.loads(payload)
            if "error" in parsed:
                return f"error event in a 200 stream: {parsed['error'].get('message')}"
        return None
    try:
        json.loads(text)
    except ValueError:
        return f"200 with a body that is not JSON: {text[:200]!r}"
    return None


def send(client: httpx.Client, case: FuzzCase, deadline: float) -> Outcome:
    if time.monotonic() > deadline:
        return Outcome(case, problem="not sent: the fuzz deadline passed")
    try:
        response = client.post(case.route, content=case.body, headers=JSON_HEADERS)
    except httpx.TimeoutException:
        return Outcome(case, problem=f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
    except httpx.TransportError as error:
        return Outcome(case, problem=f"connection dropped: {type(error).__name__}: {error}")
    return Outcome(case, response.status_code, judge(response))


def run_fuzz(url: str, cases: list[FuzzCase]) -> list[Outcome]:
    """Send every case from NUM_CLIENTS concurrent clients; the outcomes in case order."""
    deadline = time.monotonic() + FUZZ_DEADLINE_S
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(cases)):
        todo.put(index)
    outcomes: list[Outcome | None] = [None] * len(cases)

    def client_loop() -> None:
        # No keep-alive: a fresh connection per case, so that a connection one case
        # broke is never blamed on the next.
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S,
                          limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                outcomes[index] = send(client, cases[index], deadline)

    clients = [threading.Thread(target=client_loop, name=f"fuzz-client-{i}", daemon=True)
               for i in range(NUM_CLIENTS)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(FUZZ_DEADLINE_S + 2 * REQUEST_TIMEOUT_S)
    return [outcome or Outcome(case, problem="no outcome: its client never finished")
            for outcome, case in zip(outcomes, cases, strict=True)]


def report(outcomes: list[Outcome]) -> list[str]:
    """Failures grouped by kind, with example requests."""
    by_kind: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.problem is not None:
            kind = outcome.problem.split(":")[0] if outcome.problem.startswith("error event") \
                else outcome.problem[:120]
            by_kind.setdefault(kind, []).append(outcome)
    lines = []
    for kind, failed in sorted(by_kind.items(), key=lambda item: -len(item[1])):
        lines.append(f"{len(failed)} x {kind}")
        for outcome in failed[:SHOWN_PER_KIND]:
            lines.append(f"    {outcome.case.describe()}  ->  {outcome.problem}")
    return lines


def wait_idle(client: httpx.Client) -> dict[str, float]:
    """The scraped metrics once no request runs or waits (or the last scrape)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        values = scrape(client)
        busy = values.get("hicache_running_requests", 0) + values.get(
            "hicache_waiting_requests", 0)
        if busy == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def scrape(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if not sample.labels
    }


def test_hostile_requests_never_break_the_server(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        cases = fuzz_cases(SEED, NUM_CASES, model)
        watch = HealthWatch(server.url)
        poller = threading.Thread(target=watch.run, name="fuzz-health", daemon=True)
        poller.start()
        started = time.monotonic()
        try:
            outcomes = run_fuzz(server.url, cases)
        finally:
            watch.stop()
            poller.join(HEALTH_LIMIT_S + 5)
        took_s = time.monotonic() - started

        problems = report(outcomes)
        if watch.stalls:
            problems.append(
                f"/health: {len(watch.stalls)} of {watch.num_polls} polls failed or took "
                f">= {HEALTH_LIMIT_S} s (worst {watch.worst_s:.2f} s): "
                + "; ".join(watch.stalls[:5])
            )
        # Afterwards: still serving, idle, and measurable.
        if server.process is None or server.process.poll() is not None:
            problems.append("the server process exited")
        else:
            try:
                after = client.post("/v1/completions", json={
                    "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True,
                })
                if after.status_code != 200 or after.json()["usage"]["completion_tokens"] != 4:
                    problems.append(f"a normal request afterwards: {after.status_code} "
                                    f"{after.text[:200]}")
                values = wait_idle(client)
                busy = values.get("hicache_running_requests", 0) + values.get(
                    "hicache_waiting_requests", 0)
                if busy:
                    problems.append(f"not idle {IDLE_TIMEOUT_S:.0f} s after the fuzz: {busy} "
                                    "requests running or waiting")
                answered = sum(1 for o in outcomes if o.status is not None and o.status < 300)
                if values.get("hicache_requests_finished_total", 0) < answered:
                    problems.append(f"/metrics counts fewer finished requests than the "
                                    f"{answered} answered with 2xx: {values}")
            except httpx.HTTPError as error:
                problems.append(f"the server stopped answering: {type(error).__name__}")
        num_tracebacks = server.log_text().count("Traceback (most recent call last)")
        if num_tracebacks:
            problems.append(f"the server logged {num_tracebacks} tracebacks; its log ends:\n"
                            f"{server.log_tail(20)}")

    statuses = Counter(o.status for o in outcomes)
    summary = (f"{len(cases)} cases in {took_s:.1f} s, statuses {dict(statuses)}, "
               f"/health worst {watch.worst_s:.2f} s over {watch.num_polls} polls")
    assert not problems, summary + "\n" + "\n".join(problems)
    # The fuzz exercised both sides: accepted requests and refused ones.
    assert statuses.get(200, 0) >= 20 and sum(
        n for s, n in statuses.items() if s is not None and 400 <= s < 500) >= 100, summary
