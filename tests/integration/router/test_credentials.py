"""A worker registered with credentials in its URL (``http://user:password@host:port``): the
router reaches it with them, and no answer, metric, worker list or log line repeats them."""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit

import httpx
import pytest

from hicache.router.credentials import RedactingFilter, install_log_redaction, redact
from hicache.router.settings import PrefillEndpoint
from hicache.router.workers import WorkerInfo
from tests.router_fakes import FakeWorker, dropping_server, fake_workers
from tests.router_fixtures import running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances

IDS = list(range(100, 110))
SECRET = "s3cr3t-pw"


def with_credentials(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://admin:{SECRET}@{parts.netloc}"


@pytest.mark.parametrize(("text", "expected"), [
    ("http://u:p@127.0.0.1:8000", "http://***@127.0.0.1:8000"),
    ("worker https://user@host:1/x failed", "worker https://***@host:1/x failed"),
    ("a: 'http://a%40b:c:d@h:1', b: http://h:2", "a: 'http://***@h:1', b: http://h:2"),
    ("two http://a:b@h:1 and http://c:d@h:2", "two http://***@h:1 and http://***@h:2"),
    ("mail me at someone@example.com", "mail me at someone@example.com"),
    ("http://h:1/path?next=a@b", "http://h:1/path?next=a@b"),
])
def test_redact_masks_the_user_info_of_every_url(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_no_answer_metric_or_list_repeats_a_workers_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As `hicache router` does at start: every handler's records pass the filter.
    install_log_redaction()
    caplog.set_level(logging.INFO)
    try:
        with dropping_server() as dropping, fake_workers(FakeWorker()) as urls:
            good = with_credentials(urls[0])
            broken = WorkerInfo(url=with_credentials(dropping), page_size=4, model="tiny-model")
            dead = with_credentials("http://127.0.0.1:9")
            with running_router([good], extra_workers=[broken], health_interval_s=60) as router:
                # Routed through the broken worker first (FirstPolicy), then the good one:
                # the router reached it with its credentials.
                assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
                added = router.post("/workers", json={"url": dead})
                assert added.status_code == 502
                assert "http://***@127.0.0.1:9" in added.json()["error"]["message"]
                flushed = router.post("/flush_cache")
                texts = [added.text, flushed.text, router.get("/metrics").text,
                         router.get("/workers").text, router.get("/get_server_info").text]
                assert "***@" in flushed.text and "***@" in texts[2]
            with running_router(extra_workers=[WorkerInfo(url=dead, page_size=4,
                                                          model="tiny-model")],
                                health_interval_s=60) as router:
                refused = router.post("/generate", json={"input_ids": IDS})
                assert refused.status_code == 503
                assert "http://***@127.0.0.1:9 failed before answering" in refused.text
                texts.append(refused.text)
        for text in texts:
            assert SECRET not in text
        assert "***@" in caplog.text  # the failures were logged, masked
        assert SECRET not in caplog.text
    finally:
        for handler in logging.getLogger().handlers:
            for log_filter in [f for f in handler.filters if isinstance(f, RedactingFilter)]:
                handler.removeFilter(log_filter)


def test_the_pd_routers_502_names_the_instance_without_its_credentials() -> None:
    with dropping_server() as dropping, fake_instances(
        FakeInstance("prefill", Rooms(), delay_s=30.0),
    ) as (p,):
        broken = WorkerInfo(url=with_credentials(dropping), page_size=4, model="tiny-model")
        with running_pd_router([PrefillEndpoint(p)], [], extra_decode=[broken],
                               health_interval_s=60) as router:
            response = router.post("/generate", json={"input_ids": IDS})
            assert response.status_code == 502
            message = response.json()["error"]["message"]
            assert message.startswith(f"decode instance http://***@{urlsplit(dropping).netloc}")
            for text in (message, router.get("/metrics").text, router.get("/workers").text,
                         router.get("/get_server_info").text):
                assert SECRET not in text


def test_the_filter_masks_arguments_and_tracebacks() -> None:
    record = logging.LogRecord("hicache.router", logging.WARNING, __file__, 1,
                               "worker %s is down: %s", (f"http://a:{SECRET}@h:1", "refused"),
                               None)
    try:
        raise httpx.ConnectError(f"cannot reach http://a:{SECRET}@h:1")
    except httpx.ConnectError:
        record.exc_info = sys.exc_info()
    assert RedactingFilter().filter(record)
    line = logging.Formatter().format(record)
    assert "worker http://***@h:1 is down: refused" in line
    assert "ConnectError" in line and SECRET not in line
