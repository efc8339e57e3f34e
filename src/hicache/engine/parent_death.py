"""A child process that never outlives its parent: ``follow_parent``.

The engine process and the tensor-parallel rank processes serve one ``hicache
serve``; once it is gone (killed with SIGKILL, or crashed) nothing can reach them,
and what they hold (the KV event ports, the disaggregation bootstrap port, a
store's client, gigabytes of pinned memory) must be let go at once, so that the
server can be started again on the same ports. Three signals of the parent's
death, each enough alone:

- Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel sends
  ``PARENT_DEATH_SIGNAL`` when the parent dies. It is sent when the *thread* that
  started the child ends, too (the child then belongs to another thread of the
  same live parent): the signal alone proves nothing, so the parent's pid is
  compared, and a child whose parent is alive ignores it. Set right after start;
  a parent that died before it was set is seen by the same comparison, made after.
- A poll of the parent's pid every ``POLL_INTERVAL_S``, for systems without that
  signal and for a signal lost in between.
- The engine process's pipe to the server reaching its end (``engine_process``).

The signal is received through ``signal.set_wakeup_fd`` by a watcher thread of
its own, not by a Python handler on the main thread: the main thread may be deep
in a build (loading weights, attaching a store that does not answer) for minutes
and would run a handler only when it came back. ``on_orphaned`` runs once, on the
watcher thread; it is expected to end the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

logger = logging.getLogger(__name__)

# "Hang up": the parent hung up. A terminal closing sends it to the whole process group:
# the engine ignores it while its server lives, and follows the server when it ends.
PARENT_DEATH_SIGNAL: Final = signal.SIGHUP
POLL_INTERVAL_S: Final = 1.0
_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel for ``signum`` when this process's parent dies; False where
    there is no such request (not Linux, or libc refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def follow_parent(parent_pid: int, on_orphaned: Callable[[str], Any]) -> None:
    """Call ``on_orphaned(reason)`` once, on a thread of its own, as soon as
    ``parent_pid`` is no longer this process's parent. Call from the main thread
    (signal handlers are installed there), first thing in the child."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd requires it: a handler never blocks
    # A Python handler (a no-op) so that the C handler writes the signal to the fd.
    signal.signal(PARENT_DEATH_SIGNAL, lambda signum, frame: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    armed = set_parent_death_signal(PARENT_DEATH_SIGNAL)
    watcher = threading.Thread(
        target=_watch, args=(parent_pid, read_end, on_orphaned), name="hicache-parent-watch",
        daemon=True,
    )
    watcher.start()  # it looks at the parent first: one that died before prctl is seen
    if not armed:
        logger.debug("no parent-death signal here: polling the parent every %.0f s",
                     POLL_INTERVAL_S)


def _watch(parent_pid: int, wakeups: int, on_orphaned: Callable[[str], Any]) -> None:
    while os.getppid() == parent_pid:
        ready, _, _ = select.select([wakeups], [], [], POLL_INTERVAL_S)
        if ready:
            os.read(wakeups, 512)  # whatever signals woke it: the parent is looked at anew
    on_orphaned(f"the parent process {parent_pid} is gone")
