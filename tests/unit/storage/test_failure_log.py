"""The L3 failure log: each reason once at WARNING when it first appears, then at most one
summary line per reason per interval with the count since the last line."""

from __future__ import annotations

import logging

import pytest

from hicache.storage.failure_log import FailureLog

LOGGER = "hicache.storage.failure_log"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    found = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    caplog.clear()
    return found


def test_the_first_of_each_reason_is_a_warning_saying_what_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = FailureLog("file", clock=FakeClock())
    log.observe("backend", {"corrupt": 1})
    [(level, text)] = lines(caplog)
    assert level == logging.WARNING
    assert "L3 file" in text and "'corrupt' x1 (backend)" in text
    assert "failed its checksum" in text  # what it means, not just the reason's name
    # Another reason, and the controller's own, each get their own first line.
    log.observe("backend", {"corrupt": 1, "no_space": 2})
    log.observe("controller", {"breaker_open": 1})
    found = lines(caplog)
    assert [level for level, _ in found] == [logging.WARNING, logging.WARNING]
    assert "'no_space' x2 (backend)" in found[0][1] and "no room" in found[0][1]
    assert "'breaker_open' x1 (controller)" in found[1][1]


def test_repeats_are_summarised_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    log = FailureLog("file", clock=clock)
    log.observe("backend", {"corrupt": 1})
    assert len(lines(caplog)) == 1
    for total in range(2, 12):  # ten more within the minute: silent
        clock.now += 5.0
        log.observe("backend", {"corrupt": total})
    assert lines(caplog) == []
    clock.now += 11.0  # 61 s after the first line: one summary with the count since
    log.observe("backend", {"corrupt": 13})
    [(level, text)] = lines(caplog)
    assert level == logging.WARNING
    assert "'corrupt' x12 more (backend) in the last 61 s, 13 in all" in text
    clock.now += 30.0
    log.observe("backend", {"corrupt": 14})
    assert lines(caplog) == []
    # Unchanged or stale (lower) totals from a concurrent reader are not new failures.
    log.observe("backend", {"corrupt": 12})
    log.observe("backend", {"corrupt": 14})
    # What is still unlogged comes out when the store is detached.
    log.flush()
    [(_, text)] = lines(caplog)
    assert "'corrupt' x1 more (backend) in the last 30 s, 14 in all" in text
    log.flush()
    assert lines(caplog) == []


def test_routine_reasons_are_info_and_unknown_ones_still_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = FailureLog("mooncake", clock=FakeClock())
    log.observe("backend", {"evicted": 3, "mooncake_error_42": 1})
    found = dict((text.split("'")[1], level) for level, text in lines(caplog))
    assert found == {"evicted": logging.INFO, "mooncake_error_42": logging.WARNING}
