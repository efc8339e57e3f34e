"""DELETE /hicache/tenants/{tenant} on a real server (tiny model, L2 on, a file L3, KV
events on): the tenant's pages leave L1 and L2, its next request is cold and answers as
cold, another tenant's identical prompt stays a hit; the admin key, bad names (400) and
idempotence; the KV events announce the removal from each tier, L3 (EXTERNAL) included;
a running request of the tenant is aborted first. /metrics shows each tenant's bytes.

L3 is the real file store: the purge removes the tenant's files (its directory under
``tenants/`` and those of the namespaces nested in it) and no other tenant's, and the
usage in /metrics is what the store counts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.events.messages import MEDIUM_CPU, MEDIUM_EXTERNAL, MEDIUM_GPU, BlockRemoved
from hicache.storage.backends.file.tenant_dirs import tenant_root
from tests.integration.events.test_engine_events import TOPIC, EventReader
from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
KEY = "purge-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = httpx.Timeout(60.0)


def l3_pages(l3_dir: Path, tenant: str) -> list[Path]:
    """The page files of ``tenant`` in the file store (``file.tenant_dirs``)."""
    return [path for path in Path(tenant_root(str(l3_dir), tenant)).glob("??/*.?m")
            if path.is_file()]


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def server(l3_dir: Path) -> Iterator[RunningServer]:
    events = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    args = ["--enable-hierarchical-cache", "--page-size", str(PAGE),
            "--hicache-reuse-policy", "load",
            "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"path": str(l3_dir)}),
            "--kv-events-config", json.dumps(events)]
    with serve_in_thread(args, admin_api_key=KEY) as running:
        assert running.engine.cache.storage is not None
        yield running


def prompt(seed: int, pages: int = 3) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(pages * PAGE + 3)]


def generate(server: RunningServer, ids: list[int], tenant: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    if tenant is not None:
        body["extra_key"] = tenant
    response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def settle(server: RunningServer) -> None:
    """Idle, every copy landed and every L3 put finished and acknowledged."""
    assert server.wait_idle()

    def drain() -> None:
        cache = server.engine.cache
        cache.poll(wait=True)
        if cache.storage is not None:
            assert cache.storage.controller.wait_idle(timeout=60.0)
            cache.storage.poll()

    server.engine.scheduler.call(drain).result(timeout=60.0)


def purge(server: RunningServer, tenant: str, headers: dict[str, str] | None = None,
          **params: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/hicache/tenants/{tenant}", timeout=TIMEOUT,
                        headers=ADMIN if headers is None else headers, params=params)


def test_purge_makes_the_tenant_cold_and_leaves_another_tenant_hit(
    server: RunningServer, l3_dir: Path,
) -> None:
    ids = prompt(1)
    cold_a = generate(server, ids, "tenant-a")
    cold_b = generate(server, ids, "tenant-b")
    assert cold_a["meta_info"]["cached_tokens"] == 0
    assert cold_b["meta_info"]["cached_tokens"] == 0  # tenants never share pages
    warm_a = generate(server, ids, "tenant-a")
    assert warm_a["meta_info"]["cached_tokens"] >= 3 * PAGE
    assert warm_a["output_ids"] == cold_a["output_ids"]
    settle(server)
    tree = server.engine.cache.tree
    device_a = tree.tenant_device_pages("tenant-a")
    host_a = tree.tenant_host_pages("tenant-a")
    assert device_a >= 3 and host_a >= 3
    held_b = (tree.tenant_device_pages("tenant-b"), tree.tenant_host_pages("tenant-b"))
    files_a = len(l3_pages(l3_dir, "tenant-a"))
    files_b = sorted(l3_pages(l3_dir, "tenant-b"))
    assert files_a >= 3 and len(files_b) >= 3

    response = purge(server, "tenant-a")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer == {
        "tenant": "tenant-a", "device_pages": device_a, "host_pages": host_a,
        "kept_device_pages": 0, "kept_host_pages": 0, "l3_objects": answer["l3_objects"],
        "aborted_requests": 0,
    }
    assert answer["l3_objects"] == files_a
    assert l3_pages(l3_dir, "tenant-a") == []
    assert sorted(l3_pages(l3_dir, "tenant-b")) == files_b  # another tenant's files stay
    assert tree.tenant_device_pages("tenant-a") == tree.tenant_host_pages("tenant-a") == 0
    assert (tree.tenant_device_pages("tenant-b"), tree.tenant_host_pages("tenant-b")) == held_b

    again_a = generate(server, ids, "tenant-a")
    assert again_a["meta_info"]["cached_tokens"] == 0  # cold in every tier
    assert again_a["output_ids"] == cold_a["output_ids"]
    again_b = generate(server, ids, "tenant-b")
    assert again_b["meta_info"]["cached_tokens"] >= 3 * PAGE
    assert again_b["output_ids"] == cold_b["output_ids"]
    settle(server)
    server.engine.check_integrity()


def test_the_kv_events_announce_the_removal(server: RunningServer) -> None:
    ids = prompt(2)
    generate(server, ids, "tenant-e")
    settle(server)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        reader = EventReader(context, server.engine)
        reader.take(1)  # everything so far (replayed from the start)
        response = purge(server, "tenant-e")
        assert response.status_code == 200, response.text
        events = reader.take(3)
    finally:
        context.destroy(linger=0)
    removed: dict[str, set[int]] = {}
    for event in events:
        assert isinstance(event, BlockRemoved), event
        removed.setdefault(event.medium, set()).update(event.block_hashes)
    # A non-default tenant's pages hash in its own chain (events/hashing.tenant_root_digest).
    prompt_pages = set(page_hashes(ids, PAGE, tenant_root_digest("tenant-e"))[:3])
    for medium in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_EXTERNAL):
        assert prompt_pages <= removed.get(medium, set()), f"{medium}: {removed}"


def test_the_default_tenant_and_idempotence(server: RunningServer) -> None:
    ids = prompt(3)
    generate(server, ids, None)
    settle(server)
    assert server.engine.cache.tree.tenant_device_pages(None) >= 3
    first = purge(server, "default")
    assert first.status_code == 200, first.text
    assert first.json()["device_pages"] >= 3
    assert server.engine.cache.tree.tenant_device_pages(None) == 0
    for name in ("default", "never-seen"):  # nothing (left) to remove: zeros, not an error
        again = purge(server, name)
        assert again.status_code == 200, again.text
        body = again.json()
        assert body["tenant"] == name
        assert (body["device_pages"], body["host_pages"], body["aborted_requests"]) == (0, 0, 0)


def test_the_admin_key_is_required(server: RunningServer) -> None:
    generate(server, prompt(4), "tenant-k")
    settle(server)
    before = server.engine.cache.tree.tenant_device_pages("tenant-k")
    assert purge(server, "tenant-k", headers={}).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert purge(server, "tenant-k", headers=wrong).status_code == 401
    assert server.engine.cache.tree.tenant_device_pages("tenant-k") == before > 0


@pytest.mark.parametrize("name", ["has space", "x" * 129, "semi;colon", "%00"])
def test_a_bad_tenant_name_is_a_400_and_changes_nothing(
    server: RunningServer, name: str,
) -> None:
    pages = dict(server.engine.cache.tree.device_pages_by_tenant)
    response = purge(server, name)
    assert response.status_code == 400, response.text
    assert "tenant name" in response.text
    assert server.engine.cache.tree.device_pages_by_tenant == pages


@pytest.mark.parametrize("timeout", ["0", "-1", "1000", "soon"])
def test_a_bad_timeout_is_a_400(server: RunningServer, timeout: str) -> None:
    response = purge(server, "tenant-x", timeout_s=timeout)
    assert response.status_code == 400, response.text
    assert "timeout_s" in response.text


def test_a_running_request_of_the_tenant_is_aborted_first(server: RunningServer) -> None:
    payload = {
        "input_ids": prompt(5), "extra_key": "tenant-s", "stream": True,
        "sampling_params": {"max_new_tokens": server.engine.max_context_len - 4 * PAGE,
                            "ignore_eos": True},
    }
    with httpx.Client(timeout=TIMEOUT) as client, client.stream(
        "POST", f"{server.url}/generate", json=payload
    ) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")  # it runs
        response = purge(server, "tenant-s")
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["aborted_requests"] == 1
        assert answer["kept_device_pages"] == answer["kept_host_pages"] == 0
        rest = "\n".join(lines)  # the stream ends (aborted), it does not run on
    assert '"abort"' in rest or "error" in rest, rest[-500:]
    settle(server)
    tree = server.engine.cache.tree
    assert tree.tenant_device_pages("tenant-s") == tree.tenant_host_pages("tenant-s") == 0
    server.engine.check_integrity()


def tenant_bytes(server: RunningServer) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("hicache_tenant_bytes{"):
            labels, value = line.rsplit(" ", 1)
            pairs = dict(item.split("=", 1) for item in labels[labels.index("{") + 1 : -1]
                         .split(","))
            out[(pairs["tier"].strip('"'), pairs["tenant"].strip('"'))] = float(value)
    return out


def test_metrics_show_each_tenants_bytes_per_tier(server: RunningServer) -> None:
    generate(server, prompt(6), "tenant-m")
    settle(server)
    cache = server.engine.cache
    assert cache.host_pool is not None
    tree = cache.tree
    device = tree.tenant_device_pages("tenant-m") * cache.device_pool.page_bytes
    host = tree.tenant_host_pages("tenant-m") * cache.host_pool.page_bytes
    got = tenant_bytes(server)
    assert got[("device", "tenant-m")] == device > 0
    assert got[("host", "tenant-m")] == host > 0
    assert cache.storage is not None
    usage = cache.storage.controller.tenant_usage()
    assert usage is not None
    assert got[("l3", "tenant-m")] == usage["tenant-m"] >= 3 * cache.host_pool.page_bytes
    assert purge(server, "tenant-m").status_code == 200
    after = tenant_bytes(server)
    for tier in ("device", "host", "l3"):
        assert (tier, "tenant-m") not in after, after


def test_metrics_have_no_l3_series_while_the_store_cannot_tell(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that does not know (yet) who holds what (``tenant_usage()`` None) gives no
    l3 series rather than zeros; the device and host tiers are reported all the same."""
    generate(server, prompt(8), "tenant-u")
    settle(server)
    storage = server.engine.cache.storage
    assert storage is not None
    assert ("l3", "tenant-u") in tenant_bytes(server)
    monkeypatch.setattr(storage.controller, "tenant_usage", lambda: None)
    got = tenant_bytes(server)
    assert [key for key in got if key[0] == "l3"] == []
    assert got[("device", "tenant-u")] > 0


def test_a_purge_takes_the_namespaces_nested_in_the_tenant(
    server: RunningServer, l3_dir: Path,
) -> None:
    """A tenant named by a cache salt is the tenant of that name: the purge of "tenant-n"
    removes its own pages, those of an extra key inside its salt ("tenant-n" NUL "e") and
    of a salt nested under it ("tenant-n/s1", as an authenticated tenant's salt), and
    nothing of "tenant-nx", whose name only starts alike: in every tier, L3 included
    (with the load policy a page left in L3 would answer the next request)."""
    ids = prompt(7)
    bodies: dict[str, dict[str, Any]] = {
        "own": {"cache_salt": "tenant-n"},
        "extra key inside": {"cache_salt": "tenant-n", "extra_key": "e"},
        "nested salt": {"extra_key": "tenant-n/s1"},
        "look-alike": {"cache_salt": "tenant-nx"},
    }

    def run(body: dict[str, Any]) -> int:
        response = httpx.post(f"{server.url}/generate", timeout=TIMEOUT, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            **body,
        })
        assert response.status_code == 200, response.text
        cached: int = response.json()["meta_info"]["cached_tokens"]
        return cached

    for body in bodies.values():
        assert run(body) == 0  # every namespace starts cold: none shares another's pages
    settle(server)
    for body in bodies.values():
        assert run(body) >= 3 * PAGE
    settle(server)
    namespaces = ("tenant-n", "tenant-n\x00e", "tenant-n/s1")
    assert all(len(l3_pages(l3_dir, name)) >= 3 for name in (*namespaces, "tenant-nx"))
    response = purge(server, "tenant-n")
    assert response.status_code == 200, response.text
    assert response.json()["host_pages"] + response.json()["device_pages"] >= 3 * 3
    assert response.json()["l3_objects"] >= 3 * 3
    assert [name for name in namespaces if l3_pages(l3_dir, name)] == []
    assert len(l3_pages(l3_dir, "tenant-nx")) >= 3
    after = {name: run(body) for name, body in bodies.items()}
    assert after["own"] == after["extra key inside"] == after["nested salt"] == 0, after
    assert after["look-alike"] >= 3 * PAGE, after
    settle(server)
    server.engine.check_integrity()


def test_a_slow_l3_purge_does_not_hold_the_scheduler(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The store's purge blocks until released: requests keep being served meanwhile
    # (the scheduler only queues the purge; the endpoint's thread waits for it).
    ids = prompt(61)
    generate(server, ids, "tenant-w")
    settle(server)
    storage = server.engine.cache.storage
    assert storage is not None
    backend = storage.controller.backend
    entered, release = threading.Event(), threading.Event()
    real = backend.purge_tenant

    def slow_purge(tenant: str | None) -> int:
        entered.set()
        assert release.wait(60.0)
        return real(tenant)

    monkeypatch.setattr(backend, "purge_tenant", slow_purge)
    answers: list[httpx.Response] = []
    deleting = threading.Thread(target=lambda: answers.append(purge(server, "tenant-w")))
    deleting.start()
    try:
        assert entered.wait(60.0), "the store's purge never started"
        served = generate(server, prompt(62), "tenant-v")  # while the purge is blocked
        assert served["meta_info"]["completion_tokens"] == 4
        assert not answers  # the purge is still waiting for the store
    finally:
        release.set()
        deleting.join(60.0)
    assert len(answers) == 1 and answers[0].status_code == 200, answers
    assert answers[0].json()["l3_objects"] >= 1
