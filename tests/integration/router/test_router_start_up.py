"""``hicache router`` start-up against workers that do not fit together (fake workers on
loopback): it exits 2 naming both values."""

from __future__ import annotations

import logging

import pytest

from hicache.cli import build_parser
from hicache.router.serve import main as router_main
from tests.router_fakes import DictIndex, FakeWorker, FirstPolicy, fake_workers
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances


def test_start_up_with_mismatched_workers_exits_2_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def factories() -> tuple[object, object]:
        return DictIndex, lambda index, settings, workers, costs: FirstPolicy(index)

    with fake_workers(FakeWorker(page_size=4), FakeWorker(page_size=32)) as (a, b):
        args = build_parser().parse_args(
            ["router", "--worker-urls", a, b, "--worker-startup-timeout", "5"])
        with caplog.at_level(logging.ERROR):
            assert router_main(args, factories()) == 2
    assert f"{b} has page size 32, but {a} has page size 4" in caplog.text
    args = build_parser().parse_args(["router", "--port", "70000"])
    assert router_main(args, factories()) == 2


def test_pd_start_up_refuses_an_instance_in_the_wrong_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def factories() -> tuple[object, object]:
        return DictIndex, lambda index, settings, workers, costs: FirstPolicy(index)

    rooms = Rooms()
    wrong = (FakeInstance("decode", rooms), FakeInstance("decode", rooms))
    with fake_instances(*wrong) as (a, b), caplog.at_level(logging.ERROR):
        args = build_parser().parse_args(
            ["router", "--pd-disaggregation", "--prefill", a, "--decode", b,
             "--worker-startup-timeout", "5"])
        assert router_main(args, factories()) == 2
    assert f"{a} is given as --prefill but runs with --disaggregation-mode decode" in caplog.text
    mismatched = (FakeInstance("prefill", rooms), FakeInstance("decode", rooms, page_size=16))
    with fake_instances(*mismatched) as (a, b), caplog.at_level(logging.ERROR):
        args = build_parser().parse_args(
            ["router", "--pd-disaggregation", "--prefill", a, "--decode", b,
             "--worker-startup-timeout", "5"])
        assert router_main(args, factories()) == 2
    assert f"{b} has page size 16, but {a} has page size 4" in caplog.text
