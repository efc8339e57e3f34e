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

from hicache.testing.server_process import ServerProcess
from tests.http_fuzz import FuzzCase, fuzz_cases
from tests.waiting import wait_until

SEED = 1729
NUM_CASES = 600
NUM_CLIENTS = 4
# The tiny dummy model, a small pool and a short context: every accepted case is cheap.
SERVE_FLAGS = ["--model-preset", "tiny", "--device", "cpu", "--max-total-tokens", "1024",
               "--context-length", "256"]
START_TIMEOUT_S = 120.0  # a cold interpreter imports torch first (on a busy machine too)
REQUEST_TIMEOUT_S = 30.0
# No case starts later than this after the first: about 10 s needed on a quiet machine,
# several times that on a busy one.
FUZZ_DEADLINE_S = 150.0
HEALTH_PERIOD_S = 0.1
# A poll answered later than this failed: a quiet machine answers in milliseconds, one with
# every core busy (other test processes, CPU spinners) within a few seconds; a hostile
# request holding the event loop (a huge body parsed on it, a tokenizer holding the
# interpreter lock) holds it for many seconds.
HEALTH_LIMIT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # a guard: waited for, not slept
JSON_HEADERS = {"Content-Type": "application/json"}
SHOWN_PER_KIND = 4  # example requests listed per kind of failure
RUNNING, WAITING, FINISHED = (
    "hicache_running_requests", "hicache_waiting_requests", "hicache_requests_finished_total"
)


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
                    problem = type(error).__name__
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
            try:
                parsed = json.loads(payload)
            except ValueError:
                return f"a stream event that is not JSON: {payload[:200]!r}"
            if isinstance(parsed, dict) and "error" in parsed:
                return f"error event in a 200 stream: {str(parsed['error'])[:300]}"
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
    except httpx.HTTPError as error:  # an answer httpx could not read (bad encoding ...)
        return Outcome(case, problem=f"unreadable answer: {type(error).__name__}: {error}")
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


def scrape(client: httpx.Client) -> dict[str, float]:
    """/metrics parsed as Prometheus text: unlabelled samples by name."""
    response = client.get("/metrics")
    if response.status_code != 200:
        raise AssertionError(f"/metrics answered {response.status_code}: {response.text[:200]}")
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if not sample.labels
    }
    missing = {RUNNING, WAITING, FINISHED} - values.keys()
    if missing:
        raise AssertionError(f"/metrics lacks {sorted(missing)}")
    return values


def wait_idle(client: httpx.Client) -> dict[str, float]:
    """The scraped metrics once no request runs or waits (or the last scrape)."""
    values: dict[str, float] = {}  # wait_until asks at least once

    def idle() -> bool:
        nonlocal values
        values = scrape(client)
        return values[RUNNING] + values[WAITING] == 0

    # Not asserted here: the caller reports a server that never went idle.
    wait_until(idle, IDLE_TIMEOUT_S, poll_s=0.1)
    return values


def check_afterwards(server: ServerProcess, model: str, outcomes: list[Outcome]) -> list[str]:
    """The server still serves an ordinary request, goes idle, and its metrics add up."""
    if server.process is None or server.process.poll() is not None:
        return ["the server process exited"]
    problems = []
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        try:
            after = client.post("/v1/completions", json={
                "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True,
            })
            if after.status_code != 200 or after.json()["usage"]["completion_tokens"] != 4:
                problems.append(
                    f"a normal request afterwards: {after.status_code} {after.text[:200]}"
                )
            values = wait_idle(client)
        except (httpx.HTTPError, AssertionError) as error:
            return [*problems, f"after the fuzz: {type(error).__name__}: {error}"]
    if values[RUNNING] + values[WAITING]:
        problems.append(f"not idle {IDLE_TIMEOUT_S:.0f} s after the fuzz: {values[RUNNING]} "
                        f"running, {values[WAITING]} waiting")
    # Each well answered generation (and the request just above) ran to the end.
    answered = 1 + sum(1 for o in outcomes
                       if o.status is not None and 200 <= o.status < 300 and o.problem is None)
    if values[FINISHED] < answered:
        problems.append(f"/metrics counts {values[FINISHED]:.0f} finished requests, fewer "
                        f"than the {answered} answered in full")
    return problems


def test_hostile_requests_never_break_the_server(server: ServerProcess) -> None:
    model = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
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
            f">= {HEALTH_LIMIT_S} s (a poll gives up then): " + "; ".join(watch.stalls[:5])
        )
    problems += check_afterwards(server, model, outcomes)
    num_tracebacks = server.log_text().count("Traceback (most recent call last)")
    if num_tracebacks:
        problems.append(
            f"the server logged {num_tracebacks} tracebacks; its log ends:\n{server.log_tail(20)}"
        )

    statuses = Counter(o.status for o in outcomes)
    summary = (f"{len(cases)} cases in {took_s:.1f} s, statuses {dict(statuses)}, "
               f"/health slowest {watch.worst_s:.2f} s over {watch.num_polls} polls")
    print(summary)  # shown with -rA or -s: what the fuzz did
    assert not problems, summary + "\n" + "\n".join(problems)
    # The fuzz exercised both sides: accepted requests and refused ones.
    refused = sum(n for status, n in statuses.items() if status is not None and status >= 400)
    assert statuses.get(200, 0) >= NUM_CASES // 10 and refused >= NUM_CASES // 3, summary
