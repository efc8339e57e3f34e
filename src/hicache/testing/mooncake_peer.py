"""A second Mooncake client in its own process that only lends the pool its memory.

In a Mooncake deployment the pool is spread over many machines: most pages an
instance puts land in another machine's segment and cross the transfer
engine's transport (TCP or RDMA). With a single client on one machine every
page lands in that client's own segment and moves by ``memcpy``. A
``SegmentPeer`` is the other machine, on this one: a process that sets up a
client lending ``segment_bytes`` and does nothing else, so that a client
lending none (``global_segment_size: 0``) has all its pages placed there and
moved over the transport (``hicache bench storage --mooncake-segment peer``)::

    with start_master() as master, SegmentPeer(master.address, 1 << 30, log) as peer:
        extra = {"master_server_address": master.address, "global_segment_size": 0}

It is ready once it printed ``READY_LINE``; stopping it (SIGTERM) closes the client.
Run as ``python -m hicache.testing.mooncake_peer MASTER SEGMENT_BYTES [PROTOCOL]``.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from hicache.testing.launcher import ChildProcess, LaunchError

READY_LINE = "mooncake segment peer ready"


class SegmentPeerError(LaunchError):
    """The peer exited, or its client did not come up."""


class SegmentPeer(ChildProcess):
    """A child process lending ``segment_bytes`` to the pool of the master at ``master``."""

    error = SegmentPeerError
    ready_timeout_s = 30.0

    def __init__(
        self, master: str, segment_bytes: int, log_path: Path, protocol: str = "tcp"
    ) -> None:
        super().__init__(log_path)
        self.master = master
        self.segment_bytes = segment_bytes
        self.protocol = protocol

    @property
    def name(self) -> str:
        return "the mooncake segment peer"

    def command_line(self) -> list[str]:
        return [
            sys.executable, "-m", __name__, self.master, str(self.segment_bytes), self.protocol,
        ]

    def ready(self) -> bool:
        return self.logged(READY_LINE)

    def awaited(self) -> str:
        return f"print {READY_LINE!r}"


def main(argv: list[str]) -> int:
    from hicache.storage.backends.mooncake.client import acquire_client, release_client
    from hicache.storage.backends.mooncake.settings import MooncakeSettings
    from hicache.storage.options import read_settings

    master, segment_bytes = argv[0], int(argv[1])
    protocol = argv[2] if len(argv) > 2 else "tcp"
    settings = read_settings(
        MooncakeSettings,
        {"master_server_address": master, "global_segment_size": segment_bytes,
         "protocol": protocol},
        "mooncake segment peer",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = acquire_client(settings)
    try:
        print(READY_LINE, flush=True)
        while not stop.wait(0.5):  # a bounded wait: the signal handler runs between waits
            pass
    finally:
        release_client(client)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
