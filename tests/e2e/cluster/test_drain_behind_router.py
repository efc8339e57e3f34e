"""A rolling restart of one worker behind a real ``hicache router``: no client sees it.

Two tiny ``hicache serve`` workers (CPU, KV events on) share a file L3 and sit behind
``hicache router`` (tier_aware). Both write back: a page reaches L3 only once it has a
host copy (the device evicted it, which the test's pools are too large for, or an L3
lookup host-backed the cached part of a longer prompt) or when a drain writes it. Two
prompts sent to worker 0 alone, sharing nothing with the others, so reach L3 only
through its drain.

Three clients hold multi-turn conversations through the router (one has its answers
streamed). Mid-way worker 0 gets SIGTERM and drains. Its L3 writes wait behind a gate file
(tests/gated_file_backend.py) while the test watches the router take it out of routing
as draining and the clients' requests go on; then the gate opens, the drain writes,
and the process exits 0. A new ``hicache serve`` starts at the same port with the same
flags; the clients, paused before their last turns until then, finish through it all.

Checked: no client request fails (each gets every token); the drained worker exits 0
having written its pages; the router showed it draining (/workers, /metrics), learned
the pages it wrote from its EXTERNAL events, and routes to the restarted one again; the
restarted worker answers prompts only the drained one had seen with pages from L3 and
exactly the greedy tokens of their cold answers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.bench.cluster import KV_EVENTS_FLAG, EventEndpoints
from hicache.bench.scrape import scrape
from hicache.net import free_port
from hicache.testing.server_process import ChildServer, ServerProcess
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
PAGE = 16
# Pools far above what the test sends (under 2000 tokens a worker): nothing is evicted,
# so with write back the marker prompts (below) reach L3 only through the drain.
WORKER_FLAGS = (
    "--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
    "--page-size", str(PAGE), "--num-threads", "1", "--max-total-tokens", "4096",
    "--hicache-ratio", "2", "--hicache-write-policy", "write_back",
    "--hicache-storage-prefetch-policy", "wait_complete",
    # Far past the gate's hold: the drain writes every page, none is cut by the deadline.
    "--drain-timeout-s", "120",
)
# Long store-call deadlines: a write held by the gate is not given up.
STORE = {"prefetch_threshold": PAGE, "io_timeout_s": 120.0, "prefetch_timeout_max": 120.0}
# Probes every 0.2 s: the router notices a worker leave or come back soon.
ROUTER_FLAGS = ("--policy", "tier_aware", "--health-interval", "0.2")
THREADS, TURNS = 3, 15
NEW_TOKENS = 4
DRAIN_AFTER = 9  # requests answered before the SIGTERM (others are under way)
# Each conversation waits here for the restarted worker: the turns before it that were
# not answered at the SIGTERM are all sent while the drain is held.
RESUME_TURN = 10
# Prompts only worker 0 ever sees: 6 whole pages and a partial one each.
MARKERS = [[(5 * i + 13 * n) % 50 + 201 for i in range(100)] for n in range(2)]
MARKER_PAGES = 2 * (100 // PAGE)
# Starting a worker, a request, a drain: guards against a hang, far above what a machine
# busy with other work needs.
TIMEOUT_S = 120.0


# ---------------------------------------------------------------------- the cluster
@dataclass
class Rig:
    workers: list[ServerProcess]
    router: ChildServer
    run_dir: Path
    write_gate: Path
    restarted: ChildServer | None = None


def _worker_env() -> dict[str, str]:
    # The children import the gated backend from the repository's tests package.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _worker(run_dir: Path, index: int) -> ServerProcess:
    """Worker ``index`` on the shared L3, its writes held while its own gate file exists."""
    store = {"module_path": "tests.gated_file_backend", "class_name": "GatedFileBackend",
             "path": str(run_dir / "l3"), "gate": str(run_dir / "no-read-gate"),
             "write_gate": str(_write_gate(run_dir, index)), **STORE}
    events = EventEndpoints(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    flags = [*WORKER_FLAGS, "--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config", json.dumps(store),
             KV_EVENTS_FLAG, events.config_json()]
    return ServerProcess(flags, run_dir / f"worker-{index}.log", env=_worker_env(),
                         startup_timeout_s=TIMEOUT_S, name=f"worker {index}")


def _write_gate(run_dir: Path, index: int) -> Path:
    return run_dir / f"write-gate-{index}"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    # Only worker 0's writes are ever held: worker 1 stores as usual meanwhile.
    write_gate = _write_gate(tmp_path, 0)
    workers = [_worker(tmp_path, index) for index in range(2)]
    port = free_port()
    router = ChildServer(
        [sys.executable, "-m", "hicache", "--log-level", "info", "router",
         "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *(w.url for w in workers), *ROUTER_FLAGS],
        port, tmp_path / "router.log", startup_timeout_s=TIMEOUT_S, name="the router",
    )
    rig = Rig(workers, router, tmp_path, write_gate)
    try:
        for worker in workers:  # side by side: start-up is most of the test's time
            worker.launch()
        for worker in workers:
            worker.wait_ready()
        router.start()
        yield rig
    finally:
        write_gate.unlink(missing_ok=True)  # a drain held by it may end
        router.stop()
        for server in (rig.restarted, *workers):
            if server is not None:
                server.stop()


# ---------------------------------------------------------------------- clients
@dataclass
class Conversations:
    """``THREADS`` multi-turn conversations through the router, each turn the whole
    conversation so far plus a new user message; each pauses before ``RESUME_TURN``
    until ``resume`` is set."""

    url: str
    resume: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._talk, args=(n,), daemon=True)
                        for n in range(THREADS)]
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.resume.set()  # never left waiting, also when the test failed before
        for thread in self.threads:
            thread.join(TIMEOUT_S)

    def count(self) -> int:
        with self.lock:
            return self.answered

    def reached(self, answered: int) -> bool:
        """Have ``answered`` requests been answered, or has one failed (no use waiting)?"""
        with self.lock:
            return self.answered >= answered or bool(self.failures)

    def _talk(self, seed: int) -> None:
        stream = seed == THREADS - 1  # one conversation has its answers streamed
        history = [(11 * i + 37 * seed) % 190 + 1 for i in range(3 * PAGE)]
        with httpx.Client(base_url=self.url, timeout=TIMEOUT_S) as client:
            for turn in range(TURNS):
                if turn == RESUME_TURN and not self.resume.wait(TIMEOUT_S):
                    self._failed(f"conversation {seed}: never resumed")
                    return
                prompt = [*history, *((7 * i + turn + seed) % 190 + 1 for i in range(PAGE))]
                try:
                    answer = _ask(client, prompt, stream)
                except (httpx.HTTPError, ClientFailure) as error:
                    self._failed(f"conversation {seed} turn {turn}: {error!r}")
                    return
                history = [*prompt, *answer]
                with self.lock:
                    self.answered += 1

    def _failed(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


# ---------------------------------------------------------------------- helpers
class ClientFailure(Exception):
    """What a client got instead of a whole answer."""


def _body(prompt: list[int]) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}


def _ask(client: httpx.Client, prompt: list[int], stream: bool) -> list[int]:
    """The answer's tokens, every one of them; ClientFailure otherwise."""
    if stream:
        with client.stream("POST", "/generate", json={**_body(prompt), "stream": True}) as reply:
            if reply.status_code != 200:
                raise ClientFailure(f"{reply.status_code} {reply.read()!r}")
            events = [line.removeprefix("data: ") for line in reply.iter_lines()
                      if line.startswith("data: ")]
        if len(events) < 2 or events[-1] != "[DONE]":
            raise ClientFailure(f"the stream broke off: {events[-2:]}")
        output = json.loads(events[-2])["output_ids"]  # each event has the tokens so far
    else:
        response = client.post("/generate", json=_body(prompt))
        if response.status_code != 200:
            raise ClientFailure(f"{response.status_code} {response.text}")
        output = response.json()["output_ids"]
    if len(output) != NEW_TOKENS:
        raise ClientFailure(f"{len(output)} tokens, not {NEW_TOKENS}: {output}")
    return [int(token) for token in output]


def _generate(url: str, prompt: list[int]) -> dict[str, Any]:
    reply = httpx.post(f"{url}/generate", json=_body(prompt), timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def _router_state(router: ChildServer, url: str) -> str | None:
    """The worker's state in the router's /workers: up, draining or down."""
    workers = httpx.get(f"{router.url}/workers", timeout=TIMEOUT_S).json()["workers"]
    return next((str(w["state"]) for w in workers if w["url"] == url), None)


def _external_overlap(router: ChildServer) -> float:
    """The pages of the routed prompts the router knew in the shared L3 (or above)."""
    return float(scrape(router.url).total("router_overlap_pages_sum", tier="EXTERNAL"))


def _routed_to(router: ChildServer, url: str) -> float:
    """Requests the router sent to the worker at ``url`` (whichever process it was)."""
    return float(scrape(router.url).by_label("router_requests_total", "worker").get(url, 0.0))


# ---------------------------------------------------------------------- the test
def test_a_worker_drained_and_restarted_behind_the_router_loses_no_request(rig: Rig) -> None:
    router, (drained, other) = rig.router, rig.workers
    cold = [_generate(drained.url, prompt) for prompt in MARKERS]
    assert all(answer["meta_info"]["cached_tokens"] == 0 for answer in cold), cold
    # Not in L3: later only a host copy of their pages could put them there (a worker's
    # host copies go on to L3), and none is made: nothing is evicted and no later prompt
    # shares their first page (an L3 lookup host-backs the cached part of its prompt).
    assert scrape(drained.url).total("hicache_l3_backup_pages_stored_total") == 0
    conversations = Conversations(router.url)
    conversations.start()
    try:
        assert wait_until(lambda: conversations.reached(DRAIN_AFTER), TIMEOUT_S)
        assert conversations.failures == [], conversations.failures
        rig.write_gate.touch()  # the drain's writes wait until the gate opens
        process = drained.process
        assert process is not None

        at_sigterm = conversations.count()
        process.send_signal(signal.SIGTERM)  # the server alone, as an orchestrator does

        assert wait_until(lambda: _router_state(router, drained.url) == "draining",
                          TIMEOUT_S), router.log_tail()
        metrics = scrape(router.url)
        assert metrics.total("router_worker_draining", worker=drained.url) == 1
        assert metrics.total("router_worker_up", worker=drained.url) == 0
        assert wait_until(
            lambda: scrape(drained.url).total("hicache_drain_state") == 2, TIMEOUT_S,
        ), drained.log_tail()  # writing: held by the gate
        assert scrape(drained.url).total("hicache_drain_pages_to_write") >= MARKER_PAGES
        # The conversations go on while it drains (to the other worker, or refused by
        # the draining one and sent on by the router), up to their pause.
        assert wait_until(lambda: conversations.reached(THREADS * RESUME_TURN), TIMEOUT_S)
        assert conversations.failures == [], conversations.failures
        assert conversations.count() == THREADS * RESUME_TURN  # all paused
        assert process.poll() is None  # still draining
        assert THREADS * RESUME_TURN - at_sigterm >= 1  # so some were answered during it

        rig.write_gate.unlink()
        assert process.wait(timeout=TIMEOUT_S) == 0, drained.log_tail()
        log = drained.log_text()
        assert "drain started (SIGTERM)" in log and "drain done" in log, log

        # A new worker at the same port, with the same flags (its events at the same
        # endpoints), as a rolling restart starts it.
        restarted = ChildServer(drained.command, drained.port,
                                rig.run_dir / "worker-0-restarted.log", env=_worker_env(),
                                startup_timeout_s=TIMEOUT_S, name="worker 0 restarted")
        rig.restarted = restarted
        restarted.start()
        routed_before = _routed_to(router, restarted.url)
        conversations.resume.set()
        assert wait_until(lambda: _router_state(router, restarted.url) == "up", TIMEOUT_S), \
            router.log_tail()
    finally:
        conversations.join()
    assert conversations.failures == [], conversations.failures
    assert conversations.count() == THREADS * TURNS
    assert not any(t.is_alive() for t in conversations.threads)

    # Two fresh conversations through the router, both workers idle: nothing cached
    # anywhere, so each is a tie, and ties take turns (the worker chosen least recently):
    # one of them goes to the restarted worker.
    for k in (3, 5):
        _generate(router.url, [(k * i) % 190 + 1 for i in range(2 * PAGE)])
    assert _routed_to(router, restarted.url) > routed_before, router.log_tail()
    assert scrape(router.url).total("router_worker_up") == 2
    assert _router_state(router, other.url) == "up"

    # Prompts only the drained worker saw: their pages come from what its drain wrote,
    # and the answer is the cold one. The first goes through the router: the drain
    # announced what it wrote (EXTERNAL events, before it exited), so the router counts
    # its pages in the shared L3 for both workers (a tie, which either may take: neither
    # holds them, so either reads them from the store).
    external_before = _external_overlap(router)
    urls = (restarted.url, other.url)
    routed_before = sum(_routed_to(router, url) for url in urls)
    for n, (prompt, first) in enumerate(zip(MARKERS, cold, strict=True)):
        warm = _generate(router.url if n == 0 else restarted.url, prompt)
        # Every whole page: the drain wrote them all.
        stored = warm["meta_info"]["cached_tokens_details"]["storage"]
        assert stored == len(prompt) // PAGE * PAGE, warm["meta_info"]
        assert warm["output_ids"] == first["output_ids"]
    assert _external_overlap(router) - external_before == len(MARKERS[0]) // PAGE
    assert sum(_routed_to(router, url) for url in urls) == routed_before + 1
