"""What went wrong on the way through a router, counted in its /metrics: worker failures by
stage (before an answer, a timeout, an answer that broke off), retries, and clients that
left before their answer was whole; for the plain router and the PD router alike."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import httpx
import pytest

from hicache.router.settings import PrefillEndpoint
from hicache.router.workers import WorkerInfo
from tests.abandoned_clients import held_request, leave, sample, scrape
from tests.router_fakes import FakeWorker, dropping_server, fake_workers
from tests.router_fixtures import running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances
from tests.waiting import wait_until

IDS = list(range(100, 110))


def failures(url: str, worker: str, stage: str) -> float:
    return sample(scrape(url), "router_worker_failures_total", worker=worker, stage=stage)


def left(url: str, stage: str) -> float:
    return sample(scrape(url), "router_client_disconnects_total", stage=stage)


@contextmanager
def breaking_server() -> Iterator[str]:
    """A loopback server that answers every request with a 200 status line and a piece of
    a chunked body, then closes the connection: a worker dying mid-answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, suppress(OSError):
                conn.settimeout(5.0)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_failure_before_answering_is_counted_with_its_retry() -> None:
    with fake_workers(FakeWorker()) as urls, dropping_server() as dropping:
        first = WorkerInfo(url=dropping, page_size=4, model="tiny-model")
        with running_router(urls, extra_workers=[first], health_interval_s=60) as router:
            assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
            assert failures(router.url, dropping, "before_answer") == 1
            assert failures(router.url, urls[0], "before_answer") == 0
            assert scrape(router.url)["router_retries_total"] == 1


def test_a_silent_worker_is_a_counted_timeout() -> None:
    worker = FakeWorker(answer_delay_s=30.0)
    with fake_workers(worker) as urls, running_router(urls, request_timeout_s=0.5) as router:
        response = router.post("/generate", json={"input_ids": IDS}, timeout=30)
        assert response.status_code == 504
        assert failures(router.url, urls[0], "timeout") == 1


def test_an_answer_that_breaks_off_is_counted() -> None:
    with breaking_server() as breaking:
        worker = WorkerInfo(url=breaking, page_size=4, model="tiny-model")
        with running_router(extra_workers=[worker], health_interval_s=60) as router:
            with pytest.raises(httpx.HTTPError), httpx.stream(
                "POST", f"{router.url}/generate", json={"input_ids": IDS, "stream": True},
                timeout=10,
            ) as response:
                for _ in response.iter_raw():
                    pass
            assert wait_until(lambda: failures(router.url, breaking, "mid_answer") == 1)


def test_clients_that_leave_are_counted_by_stage() -> None:
    waiting, streaming = FakeWorker(answer_delay_s=30.0), FakeWorker(stream_delay_s=1.0)
    with fake_workers(waiting) as urls, running_router(urls) as router:
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "w"})
        assert wait_until(lambda: len(waiting.requests) == 1)
        leave(sock)
        assert wait_until(lambda: waiting.cancelled == ["w"])
        assert wait_until(lambda: left(router.url, "before_answer") == 1)
        assert left(router.url, "answering") == 0
    with fake_workers(streaming) as urls, running_router(urls) as router:
        with httpx.Client(timeout=10) as client, client.stream(
            "POST", f"{router.url}/generate", json={"input_ids": IDS, "stream": True,
                                                    "tag": "s"},
        ) as response:
            next(response.iter_raw())
        assert wait_until(lambda: streaming.cancelled == ["s"])
        assert wait_until(lambda: left(router.url, "answering") == 1)
        assert left(router.url, "before_answer") == 0


def test_the_pd_router_counts_its_pairs_outcomes() -> None:
    rooms = Rooms()
    prefill, decode = FakeInstance("prefill", rooms, delay_s=30.0), FakeInstance("decode", rooms)
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "gone"})
        assert wait_until(lambda: len(prefill.requests) == 1 and len(decode.requests) == 1)
        leave(sock)
        assert wait_until(lambda: sorted(prefill.cancelled + decode.cancelled) == ["gone"] * 2)
        assert wait_until(lambda: left(router.url, "before_answer") == 1)
    with dropping_server() as dropping, fake_instances(
        FakeInstance("prefill", Rooms(), delay_s=30.0),
    ) as (p,):
        broken = WorkerInfo(url=dropping, page_size=4, model="tiny-model")
        with running_pd_router([PrefillEndpoint(p)], [], extra_decode=[broken],
                               health_interval_s=60) as router:
            response = router.post("/generate", json={"input_ids": IDS})
            assert response.status_code == 502
            assert failures(router.url, dropping, "before_answer") == 1
