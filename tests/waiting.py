"""Waiting in tests for something to happen: poll a condition until it holds.

A test never sleeps a fixed time to let something happen (a thread land a write, a
server come up, a worker be marked down): on a machine busy with other work the time is
too short, on an idle one it is wasted. It waits for the event itself with these
helpers. Their timeout only guards against a hang: it is far above what a loaded machine
needs and costs nothing when the event comes in time; callers assert on the result and
say what did not happen.

Sleeps that remain in the tests are part of a scenario (a client that waits before it
leaves, a store that is slow on purpose, a time-based backoff running out), each with
a comment saying so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0
# Short enough that a test waits little past the event, long enough not to spin a core.
POLL_S = 0.01


def wait_until(
    condition: Callable[[], object], timeout_s: float = WAIT_S, poll_s: float = POLL_S
) -> bool:
    """Poll ``condition`` until it is true; False if it never was within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


async def wait_until_async(
    condition: Callable[[], object], timeout_s: float = WAIT_S, poll_s: float = POLL_S
) -> bool:
    """``wait_until`` inside an event loop: the loop runs other tasks between polls."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
