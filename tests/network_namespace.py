"""The test session's own network namespace (Linux, as root): loopback is the only interface.

Why: the Mooncake client library opens listeners on every interface (ports
15000-17000) whatever address it is given, so a test run on a machine with a
network would be reachable from outside while the Mooncake tests run. In a
fresh network namespace only ``lo`` exists, so listening "everywhere" means
loopback only, and every other test (HTTP servers on 127.0.0.1, ``hicache
serve`` children, the ``mooncake_master`` the fixtures start) works as before.

``tests/conftest.py`` calls ``enter_private_network()`` once, from
``pytest_configure``: before any test module is imported, so before any
socket or library thread exists. The namespace belongs to the calling thread
and is inherited by the threads and processes it starts afterwards, which is
every thread and child a test makes. Where that is impossible (not root, not
Linux, ``unshare`` refused by a container's policy, or the opt-out variable
set) the session runs on the machine's network as before, and
``session_isolation().note`` says why (shown in pytest's header, and as a
warning by the Mooncake fixtures).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
from dataclasses import dataclass

# Set to 1 to keep the test session on the machine's network.
OPT_OUT_ENV = "HICACHE_TESTS_SHARE_NETWORK"

_CLONE_NEWNET = 0x40000000  # <sched.h>
_SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1  # <net/if.h>
# struct ifreq: a 16-byte interface name, then a 24-byte union whose first member
# (for these two ioctls) is the short ifr_flags.
_IFREQ = struct.Struct("16sH22x")


@dataclass(frozen=True)
class NetworkIsolation:
    private: bool  # True: this process's network namespace has loopback only
    note: str  # one line for people: what the session runs on, and why


_session: NetworkIsolation | None = None


def session_isolation() -> NetworkIsolation | None:
    """What ``enter_private_network`` did for this session; None if it never ran."""
    return _session


def interface_names() -> list[str]:
    """The network interfaces this process can see."""
    return [name for _, name in socket.if_nameindex()]


def enter_private_network() -> NetworkIsolation:
    """Move this thread (and all it starts later) into a new network namespace with
    loopback up; idempotent. Never raises: a refusal is reported in the result."""
    global _session
    if _session is None:
        _session = isolate_network()
    return _session


def _shared(reason: str) -> NetworkIsolation:
    return NetworkIsolation(
        False, f"the machine's network ({reason}); the Mooncake tests' client listens on "
        "all of its interfaces while they run",
    )


def isolate_network() -> NetworkIsolation:
    """One attempt at entering a new network namespace (``enter_private_network`` makes it
    once per session)."""
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0"):
        return _shared(f"{OPT_OUT_ENV} is set")
    if not sys.platform.startswith("linux"):
        return _shared("network namespaces need Linux")
    if os.geteuid() != 0:
        return _shared("not root, so no private network namespace")
    libc = ctypes.CDLL(None, use_errno=True)
    # Python 3.11 has no os.unshare / os.setns: call libc. The original namespace is kept
    # open so that a namespace without a working loopback can be left again.
    original = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(_CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            return _shared(f"unshare(CLONE_NEWNET) refused: {os.strerror(code)}")
        try:
            _bring_loopback_up()
        except OSError as error:
            if libc.setns(original, _CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, "cannot return to the original network namespace "
                              f"after loopback failed ({error})") from error
            return _shared(f"loopback could not be brought up in a new namespace: {error}")
    finally:
        os.close(original)
    return NetworkIsolation(True, "a private network namespace with loopback only")


def _bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        answer = fcntl.ioctl(sock, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0))
        _, flags = _IFREQ.unpack(answer)
        fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))
    names = interface_names()
    if names != ["lo"]:  # a fresh namespace has exactly one interface
        raise OSError(f"unexpected interfaces in the new namespace: {names}")
