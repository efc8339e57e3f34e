"""``follow_parent``: a child learns its parent died from the kernel's parent-death signal,
ignores the same signal when only the thread that started it ended, and sees a parent
that died before it asked. Real processes: a parent (a small Python program) and its
child, which records why it stopped; the child's poll of the parent is turned off, so
only the signal or the first look can tell it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.processes import is_gone
from tests.waiting import wait_until

WAIT_S = 30.0

# The child: argv = parent pid, the file it writes its reason to, a file to wait for
# before it follows its parent ("" for none).
CHILD = """
import os, sys, time
from pathlib import Path
from hicache.engine import parent_death
parent_death.POLL_INTERVAL_S = 3600.0
parent, out, hold = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
while hold and Path(hold).exists():
    time.sleep(0.02)
def orphaned(reason):
    out.write_text(reason)
    os._exit(0)
parent_death.follow_parent(parent, orphaned)
print("following", flush=True)
time.sleep(600)
"""

# The parent: starts the child from a thread that then ends, and says so.
PARENT = """
import os, subprocess, sys, threading, time
out, hold = sys.argv[1], sys.argv[2]
def start():
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], str(os.getpid()), out, hold],
                             stdout=subprocess.PIPE if not hold else None)
    if not hold:
        child.stdout.readline()
    print(child.pid, flush=True)
starter = threading.Thread(target=start)
starter.start()
starter.join()
print("starter ended", flush=True)
time.sleep(600)
"""


def _parent(out: Path, hold: str = "") -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(out), hold, CHILD],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "starter ended"
    return parent, child


def _wait_gone(pid: int) -> bool:
    return wait_until(lambda: is_gone(pid), WAIT_S)


def test_the_signal_ends_the_child_with_its_parent_not_with_the_starting_thread(
    tmp_path: Path,
) -> None:
    out = tmp_path / "reason"
    parent, child = _parent(out)
    try:
        # The thread that started it has ended (the kernel sent the signal then): the
        # parent lives, so does the child.
        time.sleep(1.0)
        assert not is_gone(child) and not out.exists()
        parent.kill()
        parent.wait(timeout=30)
        assert _wait_gone(child), "the child outlived its parent"
        assert out.read_text() == f"the parent process {parent.pid} is gone"
    finally:
        parent.kill()
        parent.wait(timeout=30)
        if not is_gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_parent_gone_before_the_child_follows_it_is_seen_at_once(tmp_path: Path) -> None:
    out, hold = tmp_path / "reason", tmp_path / "hold"
    hold.touch()  # the child waits before it follows its parent
    parent, child = _parent(out, str(hold))
    try:
        parent.kill()
        parent.wait(timeout=30)
        hold.unlink()  # now it follows a parent that is already gone
        assert _wait_gone(child), "the child outlived its parent"
        assert out.read_text() == f"the parent process {parent.pid} is gone"
    finally:
        parent.kill()
        parent.wait(timeout=30)
        if not is_gone(child):
            os.kill(child, signal.SIGKILL)
