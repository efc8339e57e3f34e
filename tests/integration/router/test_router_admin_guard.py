"""Through the routers, /flush_cache and /abort_request with abort_all need the admin key too.

The router fans both out to every worker, so without a guard of its own anyone
who reaches it could flush every worker's cache or stop every request. A router
with ``--admin-api-key`` answers 401 without the key (no worker is asked); with
it, the client's key goes on to the workers, which check their own: a real
worker started with the same key flushes. A router without a key passes the
client's key on all the same, so keyed workers behind an open router stay
guarded. The prefill-decode router guards the same routes over both pools.
"""

from __future__ import annotations

import httpx

from hicache.router.settings import PrefillEndpoint
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances
from tests.server_fixtures import serve_in_thread

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 60.0


def test_a_keyed_router_guards_the_fan_outs_and_passes_the_key_on() -> None:
    with serve_in_thread(admin_api_key=KEY) as worker, running_router(
        [worker.url], admin_api_key=KEY
    ) as router:
        refused = router.post("/flush_cache", timeout=TIMEOUT_S)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert "workers" not in refused.json()  # no worker was asked
        flushed = router.post("/flush_cache", timeout=TIMEOUT_S, headers=AUTH)
        assert flushed.status_code == 200, flushed.text
        assert flushed.json()["workers"][worker.url]["status"] == 200

        assert router.post("/abort_request", timeout=TIMEOUT_S,
                           json={"abort_all": True}).status_code == 401
        aborted = router.post("/abort_request", timeout=TIMEOUT_S, json={"abort_all": True},
                              headers=AUTH)
        assert aborted.status_code == 200 and aborted.json()["sent"] is True
        # One's own request by rid needs no key.
        assert router.post("/abort_request", timeout=TIMEOUT_S,
                           json={"rid": "r-1"}).status_code == 200


def test_an_open_router_passes_the_clients_key_to_keyed_workers() -> None:
    with serve_in_thread(admin_api_key=KEY) as worker, running_router([worker.url]) as router:
        refused = router.post("/flush_cache", timeout=TIMEOUT_S)
        assert refused.status_code == 401  # the worker's answer
        assert refused.json()["workers"][worker.url]["status"] == 401
        assert router.post("/flush_cache", timeout=TIMEOUT_S, headers=AUTH).status_code == 200


def test_an_open_router_in_front_of_open_workers_changes_nothing() -> None:
    a = FakeWorker()
    with fake_workers(a) as urls, running_router(urls) as router:
        assert router.post("/flush_cache").status_code == 200
        assert router.post("/abort_request", json={"abort_all": True}).status_code == 200
        assert a.flushed == 1 and a.aborts == [{"abort_all": True}]


def test_the_pd_router_guards_both_pools() -> None:
    rooms = Rooms()
    prefill, decode = FakeInstance("prefill", rooms), FakeInstance("decode", rooms)
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p, 9000)], [d], admin_api_key=KEY,
    ) as router:
        assert router.post("/flush_cache").status_code == 401
        assert router.post("/abort_request", json={"abort_all": True}).status_code == 401
        assert prefill.flushed == decode.flushed == 0 and prefill.aborts == decode.aborts == []
        assert router.post("/flush_cache", headers=AUTH).status_code == 200
        aborted = router.post("/abort_request", json={"abort_all": True}, headers=AUTH)
        assert aborted.status_code == 200 and set(aborted.json()["workers"]) == {p, d}
        assert prefill.flushed == decode.flushed == 1
        assert prefill.aborts == decode.aborts == [{"abort_all": True}]
        assert router.post("/abort_request", json={"rid": "r-1"}).status_code == 200
        assert httpx.get(f"{router.url}/health", timeout=TIMEOUT_S).status_code == 200
