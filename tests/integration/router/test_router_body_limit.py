"""The routers apply ``--max-request-bytes`` as the workers do: a 413 before the body is read.

A router (and the prefill-decode router) with a 4 KiB limit in front of fake
workers: a larger body, declared or chunked, is answered 413 by the router and
no worker hears of it; a body under the limit is routed as before.
"""

from __future__ import annotations

import json

import httpx
import pytest

from hicache.cli import build_parser
from hicache.router.settings import (
    PrefillEndpoint,
    RouterSettings,
    SettingsError,
    settings_from_args,
)
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import RunningRouter, running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances

LIMIT = 4096


def _big_body() -> bytes:
    return json.dumps({"input_ids": list(range(100, 100 + LIMIT))}).encode()


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    assert f"at most {LIMIT} bytes" in response.json()["error"]["message"]


def _refuses_big_bodies(router: RunningRouter) -> None:
    body = _big_body()
    _assert_refused(router.post("/generate", content=body,
                                headers={"content-type": "application/json"}))
    chunks = (body[i:i + 1024] for i in range(0, len(body), 1024))  # no length: chunked
    _assert_refused(router.post("/v1/completions", content=chunks,
                                headers={"content-type": "application/json"}))


def test_the_router_refuses_a_body_over_the_limit() -> None:
    worker = FakeWorker()
    with fake_workers(worker) as urls, running_router(urls, max_request_bytes=LIMIT) as router:
        _refuses_big_bodies(router)
        assert worker.requests == []
        small = router.post("/generate", json={"input_ids": [100, 101, 102, 103]})
        assert small.status_code == 200, small.text
        assert [path for path, _ in worker.requests] == ["/generate"]


def test_the_pd_router_refuses_a_body_over_the_limit() -> None:
    rooms = Rooms()
    prefill, decode = FakeInstance("prefill", rooms), FakeInstance("decode", rooms)
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p, 9000)], [d], max_request_bytes=LIMIT,
    ) as router:
        _refuses_big_bodies(router)
        assert prefill.requests == decode.requests == []


def test_the_flag_sets_the_limit() -> None:
    parser = build_parser()
    args = parser.parse_args(["router", "--worker-urls", "http://127.0.0.1:1"])
    assert settings_from_args(args).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    args = parser.parse_args(["router", "--max-request-bytes", "5000"])
    assert settings_from_args(args).max_request_bytes == 5000
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "--max-request-bytes", "0"])
    with pytest.raises(SettingsError):
        RouterSettings(max_request_bytes=-1)
