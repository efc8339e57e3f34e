"""The router's per-worker ledger of in-flight prefill: what it queues, what frees it,
and that no path (failure, disconnect, repeat) leaks seconds into the queue."""

from __future__ import annotations

import pytest

from hicache.router.ledger import PrefillLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_sent_then_first_token_then_done() -> None:
    clock = Clock()
    ledger = PrefillLedger(clock)
    first = ledger.admit(2.0)
    second = ledger.admit(1.0)
    assert ledger.queued_s() == pytest.approx(3.0)
    assert (ledger.prefilling, ledger.decoding) == (2, 0)
    clock.now += 0.5  # the worker has worked half a second on its queue
    assert ledger.queued_s() == pytest.approx(2.5)
    clock.now += 1.5
    assert first.first_token() == pytest.approx(2.0)
    assert ledger.queued_s() == pytest.approx(1.0)  # the queue moved: counted afresh
    assert (ledger.prefilling, ledger.decoding) == (1, 1)
    first.close()
    assert (ledger.prefilling, ledger.decoding) == (1, 0)
    clock.now += 5.0  # later than predicted: never below zero
    assert ledger.queued_s() == 0.0
    assert second.first_token() == pytest.approx(7.0)
    second.close()
    assert (ledger.prefilling, ledger.decoding, ledger.queued_s()) == (0, 0, 0.0)


def test_a_failure_or_a_client_gone_before_the_first_token_frees_the_entry() -> None:
    ledger = PrefillLedger(Clock())
    failed, gone, kept = ledger.admit(1.0), ledger.admit(2.0), ledger.admit(4.0)
    failed.close()  # the worker failed before answering
    gone.close()  # the client left
    assert ledger.queued_s() == pytest.approx(4.0)
    assert gone.first_token() is None  # a byte after the close changes nothing
    assert (ledger.prefilling, ledger.decoding) == (1, 0)
    kept.close()
    assert (ledger.prefilling, ledger.decoding, ledger.queued_s()) == (0, 0, 0.0)


def test_repeats_are_idempotent() -> None:
    ledger = PrefillLedger(Clock())
    entry = ledger.admit(1.0)
    assert entry.first_token() is not None
    assert entry.first_token() is None
    entry.close()
    entry.close()
    assert (ledger.prefilling, ledger.decoding) == (0, 0)


def test_an_idle_worker_starts_on_a_new_entry_when_it_arrives() -> None:
    clock = Clock()
    ledger = PrefillLedger(clock)
    clock.now += 60.0  # idle a minute: that is no work done on what comes next
    ledger.admit(1.0)
    assert ledger.queued_s() == pytest.approx(1.0)
    assert ledger.admit(-3.0) is not None  # a negative prediction counts as nothing
    assert ledger.queued_s() == pytest.approx(1.0)


def test_a_prediction_that_came_out_short_does_not_empty_the_queue_behind_it() -> None:
    clock = Clock()
    ledger = PrefillLedger(clock)
    ledger.admit(1.0)
    ledger.admit(3.0)
    clock.now += 10.0  # the first is late: the worker has not even finished it
    assert ledger.queued_s() == pytest.approx(3.0)


def test_pending_pages_count_until_the_first_token_however_the_request_ends() -> None:
    ledger = PrefillLedger(Clock())
    assert ledger.pending_pages == 0.0
    cold, warm, gone = ledger.admit(0.0, 12.0), ledger.admit(0.0, 1.5), ledger.admit(0.0, 4.0)
    assert ledger.admit(0.0, -3.0) is not None  # a negative prediction counts as none
    assert ledger.pending_pages == pytest.approx(17.5)
    cold.first_token()  # its prefill is done: it decodes, and weighs nothing here
    assert ledger.pending_pages == pytest.approx(5.5)
    gone.close()  # left before its first token
    assert ledger.pending_pages == pytest.approx(1.5)
    cold.close()
    warm.first_token()
    warm.first_token()
    assert ledger.pending_pages == 0.0


def test_in_flight_entries_end_after_their_queue_and_the_measured_decode() -> None:
    clock = Clock()
    ledger = PrefillLedger(clock)
    assert ledger.in_flight() == ()
    first = ledger.admit(1.0, held_pages=20)
    ledger.admit(0.5, held_pages=10)
    ledger.admit(0.5)  # holds nothing it said: not listed
    # No decode measured yet: an entry ends with its prefill.
    assert [(f.free_in_s, f.pages) for f in ledger.in_flight()] == [(1.0, 20), (1.5, 10)]
    clock.now += 1.0
    first.first_token()
    clock.now += 3.0
    first.close()  # 3 s from its first token to its end: the decode measured
    assert ledger.decode_s == pytest.approx(3.0)
    second = ledger.admit(1.0, held_pages=8)
    flights = ledger.in_flight()
    # The 0.5 s entry has outstayed its prediction: due now, then its decode. The new one
    # comes after the two 0.5 s prefills ahead of it (one of them worked off) and its own.
    assert [(f.free_in_s, f.pages) for f in flights] == [
        (pytest.approx(3.0), 10), (pytest.approx(0.5 + 1.0 + 3.0), 8)]
    clock.now += 1.0
    second_first = second.first_token()
    assert second_first == pytest.approx(1.0)
    clock.now += 1.0  # one second into its decode of about three
    decoding = [f for f in ledger.in_flight() if f.pages == 8]
    assert decoding[0].free_in_s == pytest.approx(2.0)
    second.close()
    assert all(f.pages != 8 for f in ledger.in_flight())
    # Later decodes move the average by a fifth of their difference.
    assert ledger.decode_s == pytest.approx(3.0 + 0.2 * (1.0 - 3.0))
