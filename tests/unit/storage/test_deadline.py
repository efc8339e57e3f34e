"""DeadlineCaller: a call past its deadline is abandoned to its runner, the next one is not."""

from __future__ import annotations

import threading
import time

from hicache.storage.deadline import Call, DeadlineCaller

# A deadline or wait that quick calls must meet even on a machine busy with other work.
GENEROUS_S = 60.0


def test_a_hung_call_is_abandoned_and_the_next_runs_on_a_fresh_runner() -> None:
    events: list[str] = []
    returned = threading.Event()

    def on_late_return(call: Call) -> None:
        events.append(f"late:{call.context}")
        returned.set()

    def on_abandon(call: Call) -> int:
        events.append("abandon")
        return 7  # handed back to on_late_return as the call's context

    caller = DeadlineCaller("test", on_late_return)
    gate = threading.Event()
    try:
        began = time.monotonic()
        hung = caller.run(lambda: gate.wait() and 1, 0.1, on_abandon)
        # The call hangs until the test lets it go: anything that waited for it would not
        # return; the bound only leaves room for a machine busy with other work.
        assert time.monotonic() - began < 20.0
        assert hung.abandoned and not hung.done and hung.context == 7
        # The runner is still stuck in the first call: this one gets its own.
        answer = caller.run(lambda: 42, GENEROUS_S, lambda call: None)
        assert answer.returned and answer.value == 42
        raised = caller.run(lambda: 1 // 0, GENEROUS_S, lambda call: None)
        assert isinstance(raised.error, ZeroDivisionError) and not raised.returned
    finally:
        gate.set()
    assert returned.wait(GENEROUS_S)
    assert events == ["abandon", "late:7"]  # abandonment is always reported first
    assert hung.done and hung.value == 1
    caller.close()


def test_a_call_within_its_deadline_reuses_the_runner() -> None:
    caller = DeadlineCaller("test", lambda call: None)
    names = [caller.run(lambda: threading.current_thread().name, GENEROUS_S, lambda c: None).value
             for _ in range(3)]
    assert len(set(names)) == 1 and names[0] != threading.current_thread().name
    caller.close()
