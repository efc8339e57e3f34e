"""The wait for device room: the requests sent there end in their predicted order until the
new one fits."""

from __future__ import annotations

from hicache.router.device_room import InFlight, room_wait_s


def test_it_fits_now_or_the_capacity_is_unknown() -> None:
    flights = [InFlight(2.0, 20), InFlight(1.0, 10)]
    assert room_wait_s(48, flights, 18) == 0.0  # 30 + 18 <= 48
    assert room_wait_s(None, flights, 40) == 0.0
    assert room_wait_s(0, flights, 40) == 0.0
    assert room_wait_s(48, [], 48) == 0.0


def test_the_soonest_ends_free_their_pages_first() -> None:
    flights = [InFlight(2.0, 20), InFlight(0.5, 10), InFlight(1.0, 15)]  # 45 held
    assert room_wait_s(48, flights, 10) == 0.5  # 35 + 10 once the first ends
    assert room_wait_s(48, flights, 25) == 1.0  # 20 + 25 once two have ended
    assert room_wait_s(48, flights, 40) == 2.0  # all of them


def test_a_request_larger_than_the_device_waits_for_everything_and_no_less_than_zero() -> None:
    assert room_wait_s(48, [InFlight(3.0, 10), InFlight(1.0, 30)], 60) == 3.0
    assert room_wait_s(48, [InFlight(-1.0, 40)], 20) == 0.0  # overdue: due now
