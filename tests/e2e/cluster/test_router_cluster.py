"""A whole cluster on loopback: a mooncake_master, three tiny ``hicache serve`` workers
sharing its store, each publishing KV events, and ``hicache router`` (tier_aware, asking
the master) in front.

One cluster serves the whole module (start-up is most of the cost), so the tests run in
file order and the ones that break something come last: a worker killed, then the master.
(Mooncake keeps a page in the memory of the worker that stored it: a killed worker's pages
are gone from the store too.)
Which worker served a request is read from the workers' own request counters (and the
router's per-worker counter).

The router and the workers' KV events are part of hicache: where either is missing the
cluster refuses to start (ClusterError) and every test here fails, none is skipped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.dev_dependency import require_dev_dependency

require_dev_dependency("mooncake.store", "pip install 'hicache[mooncake]'")

from hicache.bench.cluster import (
    KV_EVENTS_TOPIC,
    Cluster,
    ClusterConfig,
    L3Kind,
    RouterConfig,
    Worker,
    wait_for,
)
from hicache.bench.scrape import scrape

PAGE = 16
# Device pool 1024 tokens (64 pages), host 2x; L3 reads wait for the prefetch so a hit shows.
# Least-recently-used host eviction: the tests push a prefix out of the local tiers with
# other prompts, which a host core set would not let them do.
TINY_WORKER = (
    "--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
    "--page-size", str(PAGE), "--num-threads", "1",
    "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-core-fraction", "0",
)
L3_EXTRA = {"prefetch_threshold": PAGE, "global_segment_size": "16MiB",
            "local_buffer_size": "4MiB"}
# A shared page saves half a page of prefill, a host page 0.9 (the router's fixed host
# multiplier): a prefix on one worker's host beats the same prefix in the shared store.
# Health checks every 0.5 s: a killed worker is noticed quickly.
ROUTER_ARGS = ("--shared-cache-type", "hicache", "--shared-cache-multiplier", "0.5",
               "--health-interval", "0.5")
# Starting the cluster, a request, an event: guards against a hang, far above what a
# machine busy with other work needs (three workers import torch side by side).
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig(
        tmp_path_factory.mktemp("cluster"), num_workers=3, worker_args=TINY_WORKER,
        max_total_tokens=1024, hicache_ratio=2.0, l3=L3Kind.MOONCAKE, l3_extra=L3_EXTRA,
        kv_events=True, router=RouterConfig("tier_aware", ROUTER_ARGS),
        startup_timeout_s=TIMEOUT_S,
    )
    with Cluster(config) as running:
        # Every worker registered and routed to.
        assert wait_for(lambda: _router_up(running) == 3, TIMEOUT_S), _router_log(running)
        yield running


# ---------------------------------------------------------------------- helpers
def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 250 + 1 for i in range(num_tokens)]


def _generate(url: str, ids: list[int], max_new_tokens: int = 2) -> dict[str, Any]:
    reply = httpx.post(f"{url}/generate", timeout=TIMEOUT_S, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                              "ignore_eos": True},
    })
    assert reply.status_code == 200, reply.text
    meta: dict[str, Any] = reply.json()["meta_info"]
    return meta


def _served(workers: list[Worker]) -> dict[str, float]:
    """Requests each running worker accepted so far (its own counter)."""
    return {w.url: scrape(w.url).total("hicache_requests_total") for w in workers if w.running}


def _router_up(cluster: Cluster) -> int:
    return int(scrape(cluster.url).total("router_worker_up"))


def _router_log(cluster: Cluster) -> str:
    return cluster.router.log_tail() if cluster.router is not None else ""


def _stored_in_l3(worker: Worker) -> float:
    return scrape(worker.url).total("hicache_l3_backup_pages_stored_total")


# ---------------------------------------------------------------------- tests
def test_workers_share_the_mooncake_store(cluster: Cluster) -> None:
    assert cluster.master is not None and cluster.master.running
    a, b = cluster.workers[2], cluster.workers[0]
    prompt = _prompt(1, 6 * PAGE)
    before = _stored_in_l3(a)
    assert _generate(a.url, prompt)["cached_tokens"] == 0
    assert wait_for(lambda: _stored_in_l3(a) >= before + 5, TIMEOUT_S), a.server.log_tail()
    # b never saw the prompt: its pages come from a, through the store.
    details = _generate(b.url, prompt)["cached_tokens_details"]
    assert details["storage"] >= 5 * PAGE, details


def test_a_worker_publishes_its_events_in_order(cluster: Cluster) -> None:
    import zmq

    from hicache.events.messages import BlockStored, decode_batch, decode_sequence

    worker = cluster.workers[1]
    assert worker.events is not None
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
        sub.setsockopt(zmq.RCVTIMEO, 2000)
        sub.connect(worker.events.endpoint)
        # A SUB socket misses what is published before its subscription reached the
        # publisher: probe prompts until one's events arrive; from then on nothing is
        # missed. A probe is a page of tokens _prompt never gives (251-254), each its own.
        deadline = time.monotonic() + TIMEOUT_S
        for probe in itertools.count():
            assert time.monotonic() < deadline, "the worker's events never reached us"
            _generate(worker.url, [251 + (probe >> 2 * i) % 4 for i in range(PAGE)])
            try:
                sub.recv_multipart()
                break
            except zmq.Again:
                continue
        prompts = [_prompt(10 + n, 4 * PAGE) for n in range(3)]
        for ids in prompts:
            _generate(worker.url, ids)
        sequences: list[int] = []
        stored: list[list[int]] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(stored) < 3 * 4 and time.monotonic() < deadline:
            try:
                topic, raw_sequence, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            assert topic == KV_EVENTS_TOPIC.encode()
            sequences.append(decode_sequence(raw_sequence))
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored) and event.medium == "GPU":
                    stored += [event.token_ids[i:i + PAGE]
                               for i in range(0, len(event.token_ids), PAGE)]
    finally:
        sub.close(linger=0)
        context.term()
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences), sequences
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences))), "a gap"
    # Every page of every prompt was announced on the device, in the order they were sent.
    expected = [ids[i:i + PAGE] for ids in prompts for i in range(0, len(ids), PAGE)]
    assert [page for page in stored if page in expected] == expected


def test_the_router_applies_every_workers_events_without_gaps(cluster: Cluster) -> None:
    for n in range(3):
        _generate(cluster.url, _prompt(20 + n, 3 * PAGE))
    metrics = scrape(cluster.url)
    batches = metrics.by_label("router_kv_event_batches_total", "worker")
    assert wait_for(
        lambda: sum(scrape(cluster.url).by_label(
            "router_kv_event_batches_total", "worker").values()) > 0, TIMEOUT_S,
    ), batches
    metrics = scrape(cluster.url)
    for name in ("gaps", "restarts", "malformed", "replay_failures"):
        assert metrics.total(f"router_kv_event_{name}_total") == 0, (name, _router_log(cluster))
    assert metrics.total("router_indexed_pages") > 0


def test_a_prefix_on_one_workers_host_is_routed_to_that_worker(cluster: Cluster) -> None:
    owner = cluster.workers[1]
    prompt = _prompt(30, 8 * PAGE)
    _generate(owner.url, prompt)
    # Other prompts push it out of owner's device pool (64 pages): it stays in owner's host.
    for n in range(4):
        _generate(owner.url, _prompt(40 + n, 24 * PAGE))
    before = _served(cluster.workers)
    routed_before = scrape(cluster.url).by_label("router_requests_total", "worker")
    meta = _generate(cluster.url, [*prompt, *_prompt(31, PAGE)])
    after = _served(cluster.workers)
    routed = scrape(cluster.url).by_label("router_requests_total", "worker")
    got = [url for url in after if after[url] > before[url]]
    # Host pages cost a copy; the others hold the prefix at best in the shared store.
    assert got == [owner.url], (got, meta, _router_log(cluster))
    assert routed.get(owner.url, 0) == routed_before.get(owner.url, 0) + 1
    assert meta["cached_tokens_details"]["host"] >= 4 * PAGE, meta


def test_a_prefix_only_in_l3_goes_where_the_scoring_says(cluster: Cluster) -> None:
    holder = cluster.workers[2]
    prompt = _prompt(50, 8 * PAGE)
    before = _stored_in_l3(holder)
    _generate(holder.url, prompt)
    assert wait_for(lambda: _stored_in_l3(holder) >= before + 7, TIMEOUT_S)
    # 7 x 24 pages through the holder: more than its device (64) and host (128) pools, so
    # the prefix is left only in the store (whose pages live on, in the holder's segment).
    for n in range(7):
        _generate(holder.url, _prompt(100 + n, 24 * PAGE))
    before_served = _served(cluster.workers)
    meta = _generate(cluster.url, [*prompt, *_prompt(51, PAGE)])
    after_served = _served(cluster.workers)
    got = [url for url in after_served if after_served[url] > before_served[url]]
    # Every worker reaches the prefix at the same price (a shared page), none is busy: a
    # tie, which one worker takes (the one the router chose least recently), from the store.
    assert len(got) == 1, (got, meta, _router_log(cluster))
    assert meta["cached_tokens_details"]["storage"] >= 7 * PAGE, meta


def test_a_killed_worker_is_routed_around(cluster: Cluster) -> None:
    victim = cluster.workers[2]
    _generate(victim.url, _prompt(55, 4 * PAGE))
    victim.kill()
    # The router has not noticed yet: a request it sends there fails before any answer
    # and goes to the next choice. No request fails.
    for n in range(8):
        _generate(cluster.url, [*_prompt(55, 4 * PAGE), *_prompt(56 + n, PAGE)])
    assert wait_for(lambda: _router_up(cluster) == 2, 10.0), _router_log(cluster)
    assert all(scrape(w.url).total("hicache_requests_total") > 0 for w in cluster.workers[:2])


def test_the_master_killed_fails_no_request(cluster: Cluster) -> None:
    cluster.kill_master()
    # Cached prefixes, new prompts and streams: the shared-pool query fails (the router
    # scores from its index), the workers' L3 calls fail (they compute instead).
    for n in range(6):
        _generate(cluster.url, [*_prompt(70, 6 * PAGE), *_prompt(71 + n, PAGE)])
    with httpx.Client(timeout=TIMEOUT_S) as client, client.stream(
        "POST", f"{cluster.url}/generate",
        json={"input_ids": _prompt(80, 3 * PAGE), "stream": True,
              "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    ) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
    assert cluster.all_healthy()
    # Back for the teardown: a worker's store client closes in seconds with its master
    # there, and waits out a timeout without.
    assert cluster.master is not None
    cluster.master.restart()

