"""Every reason an L3 failure is counted under, and what it means for the operator.

Backends count failed pages by reason (``StorageStats.failures``) and the
storage controller counts the calls it gave up on (``StorageMetrics.failures``);
/metrics exports both as ``hicache_l3_failures_total{reason=...}`` and the
failure log (``failure_log``) explains each reason the first time it appears.

Invariant: a reason is counted only as a ``FailureReason`` (or a
``frame.Fault``, the reasons a stored object is rejected on read, whose
values are members here too), and every member has a meaning in ``MEANINGS``.
``StorageBackend._fail``, ``StorageStats.fail`` and ``StorageMetrics.fail``
take nothing else, so mypy refuses a reason spelt as a bare string; the
registry's test checks the meanings and the ``Fault`` values. Counters are keyed
by the member's value, the label /metrics shows. A backend loaded with
``--hicache-storage-backend dynamic`` is code of its own and may still count a
string of its own: ``meaning`` says so instead of failing.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from hicache.storage.frame import Fault


class FailureReason(str, Enum):
    # A stored object rejected on read (frame.Fault): it is dropped from the store.
    SHORT_READ = "short_read"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    WRONG_ORDER = "wrong_order"
    WRONG_KEY = "wrong_key"
    WRONG_LENGTH = "wrong_length"
    CORRUPT = "corrupt"
    UNKNOWN_KEY = "unknown_key"
    BAD_TAG = "bad_tag"
    # A sealed page that cannot be written: its tenant has no key in the key file.
    NO_KEY = "no_key"
    # A page that is not there to read.
    MISSING = "missing"
    NOT_READY = "not_ready"
    NOT_REGULAR_FILE = "not_regular_file"
    # The store failing a call.
    IO_ERROR = "io_error"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    NO_SPACE = "no_space"
    OVER_CAPACITY = "over_capacity"
    READ_ONLY = "read_only"
    OUT_OF_MEMORY = "out_of_memory"
    DENIED = "denied"
    CANCELLED = "cancelled"
    INVALID = "invalid"
    STORE_ERROR = "store_error"
    UNAVAILABLE = "unavailable"
    # Normal operation rather than damage.
    EVICTED = "evicted"
    EVICTED_NO_SPACE = "evicted_no_space"
    PINNED_FULL = "pinned_full"
    EVICTED_TENANT_QUOTA = "evicted_tenant_quota"
    TENANT_QUOTA_FULL = "tenant_quota_full"
    EXPIRED = "expired"
    DETACHED = "detached"
    # The storage controller: calls it did not make, or that raised.
    BREAKER_OPEN = "breaker_open"
    STALLED_LIMIT = "stalled_limit"
    EXISTS_RAISED = "exists_raised"
    GET_RAISED = "get_raised"
    SET_RAISED = "set_raised"
    DISCARD_RAISED = "discard_raised"
    PIN_RAISED = "pin_raised"
    UNPIN_RAISED = "unpin_raised"

    def __str__(self) -> str:
        return self.value


# What the counting methods take: a reason, or a rejected object's fault.
CountedReason = Union[FailureReason, "Fault"]

# Normal operation rather than damage: logged at INFO.
ROUTINE_REASONS = frozenset({
    FailureReason.EVICTED, FailureReason.DETACHED, FailureReason.EVICTED_TENANT_QUOTA,
    FailureReason.EXPIRED,
})

# What each reason means for the operator (policy as data: a new reason needs only a row).
MEANINGS: dict[FailureReason, str] = {
    FailureReason.SHORT_READ: "a stored page was shorter than a page (a torn or truncated "
    "object); it was dropped",
    FailureReason.BAD_MAGIC: "an object in the store is not a page this server wrote, or its "
    "first bytes are damaged; it was dropped",
    FailureReason.BAD_VERSION: "a page was written by an incompatible format version; it was "
    "dropped",
    FailureReason.WRONG_ORDER: "a page was written from a host pool of another memory layout; "
    "it was dropped",
    FailureReason.WRONG_KEY: "an object holds another page than its name says; it was dropped",
    FailureReason.WRONG_LENGTH: "an object has the wrong size for this model's pages; it was "
    "dropped",
    FailureReason.CORRUPT: "a stored page failed its checksum; it was dropped from L3 and its "
    "tokens are recomputed (check the disk or the network under L3)",
    FailureReason.UNKNOWN_KEY: "a sealed page names a key id the encryption key file has not "
    "for its tenant (a removed key: crypto-shredded, or another instance's key file); it was "
    "dropped and its tokens are recomputed",
    FailureReason.BAD_TAG: "a sealed page failed authentication (damaged, moved to another "
    "page's name, or sealed with another secret under the same key id); it was dropped and "
    "its tokens are recomputed",
    FailureReason.NO_KEY: "a tenant has no key in the encryption key file (no line of its own "
    "and no '*' line), so its pages are not written to L3",
    FailureReason.MISSING: "a page L3 listed was gone when read (evicted or removed by another "
    "instance); its tokens are recomputed",
    FailureReason.NOT_READY: "a page was still being written by another instance",
    FailureReason.NOT_REGULAR_FILE: "a page's name in the store's directory is not a regular "
    "file (a FIFO, device, directory or socket put there); it is read as a miss and left "
    "alone",
    FailureReason.IO_ERROR: "the store failed a read or a write (an OS or client error)",
    FailureReason.UNREACHABLE: "the store did not answer",
    FailureReason.TIMEOUT: "an L3 call ran past its deadline",
    FailureReason.NO_SPACE: "the store had no room for a page; the backup stopped there",
    FailureReason.OVER_CAPACITY: "a page is larger than the store's whole size cap",
    FailureReason.READ_ONLY: "the store refused a write because it is read-only (a Redis "
    "replica, say); point L3 at a writable one",
    FailureReason.OUT_OF_MEMORY: "the store is out of memory and refused the page",
    FailureReason.DENIED: "the store denied the call (its access rules refused this client)",
    FailureReason.CANCELLED: "the store cancelled the call before it finished",
    FailureReason.INVALID: "the store rejected the call as invalid (a client and store that "
    "disagree on the protocol or the page size)",
    FailureReason.STORE_ERROR: "the store answered with an error this server does not name "
    "(its code is in the debug log)",
    FailureReason.UNAVAILABLE: "the store could not be used at all (it failed to reopen, "
    "after a clear for instance); every call is a miss until L3 is attached again",
    FailureReason.EVICTED: "pages were evicted to stay under the store's size cap",
    FailureReason.EVICTED_NO_SPACE: "the file system under L3 was full, so least recently used "
    "pages were evicted to make room (set max_bytes below the free space to avoid this)",
    FailureReason.PINNED_FULL: "pinned pages alone fill the store's size cap, so a new page "
    "was refused rather than evicting a pinned one (unpin, shorten pins, or raise max_bytes)",
    FailureReason.EVICTED_TENANT_QUOTA: "a tenant's pages were evicted, its least recently "
    "used first, to keep it under its L3 quota (--tenant-quotas l3=)",
    FailureReason.TENANT_QUOTA_FULL: "a tenant's L3 quota could not take a page (the page is "
    "larger than the quota, or the tenant's other pages are pinned or in the same backup)",
    FailureReason.EXPIRED: "a tenant's page was older than its L3 TTL (--tenant-quotas "
    "l3_ttl=): a miss, and removed",
    FailureReason.DETACHED: "queued backups were dropped because L3 was detached",
    FailureReason.BREAKER_OPEN: "L3 calls were skipped while the circuit breaker is open after "
    "repeated failures",
    FailureReason.STALLED_LIMIT: "L3 calls were skipped because too many earlier calls are "
    "still stalled past their deadline (each holds host pages until it returns)",
    FailureReason.EXISTS_RAISED: "the backend raised on a lookup (the error is logged with it)",
    FailureReason.GET_RAISED: "the backend raised on a read (the error is logged with it)",
    FailureReason.SET_RAISED: "the backend raised on a write (the error is logged with it)",
    FailureReason.DISCARD_RAISED: "the backend raised while dropping pages found damaged (the "
    "error is logged with it)",
    FailureReason.PIN_RAISED: "the backend raised while pinning pages (the error is logged "
    "with it)",
    FailureReason.UNPIN_RAISED: "the backend raised while unpinning pages (the error is "
    "logged with it)",
}

UNDESCRIBED = "a failure reason this server has no description for"
_BY_VALUE = {reason.value: text for reason, text in MEANINGS.items()}


def meaning(reason: str) -> str:
    """What ``reason`` (a member's value, as the counters are keyed) means."""
    return _BY_VALUE.get(reason, UNDESCRIBED)


_RAISED = {"exists": FailureReason.EXISTS_RAISED, "get": FailureReason.GET_RAISED,
           "set": FailureReason.SET_RAISED, "discard": FailureReason.DISCARD_RAISED,
           "pin": FailureReason.PIN_RAISED, "unpin": FailureReason.UNPIN_RAISED}


def raised_reason(call: str) -> FailureReason:
    """The reason for a backend call (``exists``, ``get``, ``set``, ``discard``) that raised."""
    return _RAISED.get(call, FailureReason.STORE_ERROR)
