"""The "lmcache" backend: pages in an LMCache server (``lmcache_server HOST PORT cpu``) over TCP.

LMCache's standalone server keeps values in its memory, shared by every
instance that connects to it. We speak its wire format with our own client
(``client``, ``protocol``): this backend needs no LMCache
package, only a server to talk to (LMCache's, run from its own environment).

Extra config:

    remote_url         the server, lm://host:port or host:port (LMCACHE_REMOTE_URL); required
    namespace          the model-name field of our keys (default "hicache"): instances
                       with different namespaces on one server never see each other's pages
    connections        idle connections kept for reuse (default 4); each calling thread
                       uses its own connection, opened when none is idle
    timeout_s          socket timeout of every send and receive (default 5)
    connect_timeout_s  timeout of a connect (default 2)
    retry_interval_s   after a failed connect, calls fail at once as "unreachable" for this
                       long before connecting is tried again (default 1)
    verify_checksum    hash every page read against its header (default true)

Objects. Each page is one value, the page's payload followed by its ``frame``
header (as in every backend), under the key
``<namespace>.<generation>.<order tag>@1@0@<page key hex>@uint8``. The payload
is sent straight from the host pool's pages and received straight into them
(``PageRegions``), with no staging copy.

Batches are pipelined: a batch's requests go out together and their replies
are read in order, so ``exists`` and ``get`` are one round trip, ``set`` two
(which pages are stored, then the PUTs of the missing ones followed by one
HEALTH request whose reply says the server has stored them all).

What the server cannot do, and how we cope:

- No DELETE. ``clear`` starts a new *generation*: a random number stored
  under a control key, part of every page's key. Each instance reads it at
  attach and, pipelined with every ``exists`` (no extra round trip), notices
  another instance's clear. The old pages become unreachable, but the server
  keeps them in memory until it is restarted.
- No eviction: the server's memory grows with every page stored. Size it for
  the working set, or restart it (every page is then a miss, nothing breaks).
- A corrupted page cannot be removed. The instance that reads it remembers its
  key (``BAD_KEYS_REMEMBERED`` at most): ``exists`` stops there, and the next
  ``set`` of that page rewrites it (a PUT replaces the value).
- A PUT cut off mid-value (a writer killed or timed out) leaves the server
  holding an empty value that closes the connection of whoever GETs it, losing
  any reply to that connection not yet flushed. After a connection dropped
  mid-batch we reconnect and read the rest one page per round trip: the page
  whose value is cut off there is the torn one, a short read (a miss,
  remembered as bad like a corrupted page).

Failures never raise: a connect refused or timed out, a connection reset, a
socket timeout or an unreadable reply ends the call with the pages done so
far, counted as "unreachable" or "timeout" or "io_error" (feeding the storage
controller's circuit breaker), and the connection is dropped. A server that
cannot be reached at attach is a ``StorageUnavailableError``.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.lmcache.client import (
    Buffer,
    Client,
    Connection,
    ServerUnreachable,
)
from hicache.storage.backends.lmcache.protocol import (
    MAX_VALUE_BYTES,
    Command,
    ProtocolError,
    encode_request,
    key_string,
)
from hicache.storage.backends.lmcache.settings import LMCacheSettings
from hicache.storage.base import (
    LookupPutBackend,
    PutBatch,
    StorageError,
    StorageUnavailableError,
    first_gap,
)
from hicache.storage.failure_reasons import FailureReason
from hicache.storage.frame import (
    HEADER_BYTES,
    Fault,
    encode_header,
    length_fault,
)
from hicache.storage.options import read_settings
from hicache.storage.page_regions import PageRegions

BAD_KEYS_REMEMBERED = 4096
_GENERATION_BYTES = 8


# What a discarded page is overwritten with (see _drop).
_TOMBSTONE = b"\0"


@dataclass(frozen=True)
class _Drop:
    """How a read exchange ended early: the error, and whether it came mid-value."""

    error: OSError | ProtocolError
    in_value: bool


@dataclass
class _LMCachePut(PutBatch):
    client: Client
    regions: PageRegions
    names: list[str]


class LMCacheBackend(LookupPutBackend[_LMCachePut]):
    """See the module docstring."""

    name = "lmcache"

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.settings = read_settings(LMCacheSettings, self.extra_config, "lmcache storage")
        self.verify_checksum = self.settings.verify_checksum
        self._client: Client | None = None
        self._regions: PageRegions | None = None
        self._generation = 0  # guarded by self._lock
        # Keys (strings) of pages found bad: treated as missing until rewritten.
        self._bad: OrderedDict[str, None] = OrderedDict()
        self._control_key = key_string(f"{self.settings.namespace}.generation", b"\0")

    # ------------------------------------------------------------ lifecycle
    def attach(self, host: HostPool) -> None:
        self._check_attachable(self._client is not None)
        regions = PageRegions(host)
        if regions.page_bytes + HEADER_BYTES > MAX_VALUE_BYTES:
            raise StorageError(
                f"lmcache_server values hold at most {MAX_VALUE_BYTES} bytes; a page is "
                f"{regions.page_bytes}"
            )
        s = self.settings
        client = Client(
            s.host, s.port, timeout_s=s.timeout_s, connect_timeout_s=s.connect_timeout_s,
            retry_interval_s=s.retry_interval_s, max_idle=s.connections,
        )
        try:
            with client.connection() as conn:
                generation = self._read_generation(conn)
        except (OSError, ProtocolError) as error:
            client.close()
            raise StorageUnavailableError(
                f"lmcache storage: cannot reach lmcache_server at {s.address}: {error}"
            ) from error
        super().attach(host)
        self._client, self._regions = client, regions
        with self._lock:
            self._generation = generation

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def reachable(self) -> bool:
        """False within ``retry_interval_s`` of a failed connect (calls then fail at once)."""
        client, _ = self._ready([])
        return not client.seems_down()

    def server_keys(self, keys: Sequence[bytes]) -> list[str]:
        """The server-side keys of page ``keys`` now (for tools and tests)."""
        self._ready(keys)
        return self._names(keys)

    # ----------------------------------------------------------- operations
    def exists(self, keys: Sequence[bytes]) -> int:
        client, _ = self._ready(keys)
        self._count_exists_query()
        if not keys:
            return 0
        try:
            with client.connection() as conn:
                # The generation first, in the same round trip: another instance may
                # have cleared the store since we last looked.
                names = self._names(keys)
                conn.send([
                    encode_request(Command.GET, self._control_key),
                    *(encode_request(Command.EXIST, name) for name in names),
                ])
                generation = self._read_generation_reply(conn)
                found = [conn.read_reply().ok for _ in names]
                if self._set_generation(generation):
                    names = self._names(keys)
                    found = conn.exists(names)
        except (OSError, ProtocolError) as error:
            self._count_error(error, 1)
            return 0
        bad = self._bad_snapshot()
        return first_gap([ok and name not in bad for name, ok in zip(names, found, strict=True)])

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        client, regions = self._ready(keys, host_pages)
        if not keys:
            return 0
        began = time.perf_counter()
        pages = np.asarray(host_pages).tolist()
        names = self._names(keys)
        bad = self._bad_snapshot()  # found bad (or discarded): missing until stored anew
        known_bad = next((i for i, name in enumerate(names) if name in bad), None)
        if known_bad is not None:
            names = names[:known_bad]
            if not names:
                self._fail(FailureReason.MISSING)
                self._count_read(0, regions.page_bytes, began)
                return 0
        good, drop = self._read(client, regions, keys, pages, names, 0, pipelined=True)
        if drop is not None and self._dropped(drop):
            # The server closes a stream the moment it meets a torn value, and a reply it
            # had not flushed yet for an earlier page of the batch (Nagle holds a small
            # value back until its header is acknowledged) is lost with it: a drop in a
            # pipelined batch does not name its page. Read the rest one page per round
            # trip on a fresh connection, where a drop mid-value is that page's.
            more, drop = self._read(client, regions, keys, pages, names, good, pipelined=False)
            good += more
            if drop is not None and drop.in_value and self._dropped(drop):
                self._mark_bad(names[good], Fault.SHORT_READ)
                drop = None
        if drop is not None:
            self._count_error(drop.error, 1)
        if known_bad is not None and good == known_bad:
            self._fail(FailureReason.MISSING)  # the chain reached a page known bad
        self._count_read(good, regions.page_bytes, began)
        return good

    def _read(
        self, client: Client, regions: PageRegions, keys: Sequence[bytes], pages: list[int],
        names: list[str], first: int, *, pipelined: bool,
    ) -> tuple[int, _Drop | None]:
        """Read pages ``first..`` of ``names`` into ``pages``: how many leading ones were read
        and verified, and the error that ended the exchange (None when it ended by itself:
        all read, or stopped at a missing or damaged page, counted here).

        ``pipelined`` sends every GET at once; otherwise each GET waits for the previous
        reply, so that a connection the server drops is dropped at the page it was sending.
        """
        expected = regions.page_bytes + HEADER_BYTES
        header = bytearray(HEADER_BYTES)
        good = 0  # leading pages read and verified
        broken = False  # a page failed: the rest of the replies are only drained
        in_value = False  # between a page's reply header and the end of its value
        try:
            with client.connection() as conn:
                if pipelined:
                    conn.send([encode_request(Command.GET, name) for name in names[first:]])
                for current in range(first, len(names)):
                    if not pipelined:
                        if broken:
                            break
                        conn.send([encode_request(Command.GET, names[current])])
                    reply = conn.read_reply()
                    fault = length_fault(reply.value_bytes, expected) if reply.ok else None
                    if broken or not reply.ok or fault is not None:
                        conn.discard(reply.value_bytes)
                        if not broken:
                            broken = True
                            if fault is None:
                                self._fail(FailureReason.MISSING)
                            else:
                                self._mark_bad(names[current], fault)
                        continue
                    in_value = True
                    conn.read_into([*regions.views(pages[current]), header])
                    in_value = False
                    fault = regions.check_read(
                        header, pages[current], keys[current], self.verify_checksum
                    )
                    if fault is not None:
                        broken = True
                        self._mark_bad(names[current], fault)
                        continue
                    good += 1
        except (OSError, ProtocolError) as error:
            if not broken:
                return good, _Drop(error, in_value)
        return good, None

    @staticmethod
    def _dropped(drop: _Drop) -> bool:
        """Whether the server closed or reset a connection we had (not: could not connect)."""
        return isinstance(drop.error, ConnectionError) and not isinstance(
            drop.error, ServerUnreachable
        )

    def clear(self) -> None:
        """Start a new generation: every page stored so far becomes unreachable (module doc)."""
        client, _ = self._ready([])
        generation = secrets.randbits(63) | 1  # never 0, the generation of a fresh server
        value = generation.to_bytes(_GENERATION_BYTES, "little")
        try:
            with client.connection() as conn:
                conn.put([(self._control_key, [value])], self._control_key)
        except (OSError, ProtocolError) as error:
            self._count_error(error, 1)
            return
        self._set_generation(generation)
        with self._lock:
            self._bad.clear()

    # ------------------------------------------------------ put steps (set)
    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> _LMCachePut:
        client, regions = self._ready(keys, host_pages)
        return _LMCachePut(
            keys, np.asarray(host_pages).tolist(), regions.page_bytes, client, regions,
            self._names(keys),
        )

    def _lookup(self, batch: _LMCachePut) -> list[bool] | None:
        bad = self._bad_snapshot()  # found bad (or discarded): rewritten, not trusted
        try:
            with batch.client.connection() as conn:
                present = conn.exists(batch.names)
        except (OSError, ProtocolError) as error:
            self._count_error(error, 1)
            return None
        return [ok and name not in bad for ok, name in zip(present, batch.names, strict=True)]

    def _put(self, batch: _LMCachePut, todo: list[int], stored: list[bool]) -> int:
        regions, keys, pages, names = batch.regions, batch.keys, batch.pages, batch.names

        def values() -> Iterator[tuple[str, list[Buffer]]]:
            for i in todo:  # hashed one by one while the server takes the last
                views = regions.views(pages[i])
                frame = encode_header(
                    keys[i], regions.order, regions.page_bytes, regions.checksum(pages[i]),
                )
                yield names[i], [*views, frame]

        try:
            with batch.client.connection() as conn:
                conn.put(values(), self._control_key)
        except (OSError, ProtocolError) as error:
            self._count_error(error, 1)
            # Some of these PUTs may have been cut off mid-value, leaving values that
            # break their readers: rewrite them next time rather than trust them.
            self._remember_bad([names[i] for i in todo])
            return 0
        for i in todo:
            stored[i] = True
        self._forget_bad([names[i] for i in todo])
        return len(todo)

    # ------------------------------------------------------------ internals
    def _ready(
        self, keys: Sequence[bytes], host_pages: PageIds | None = None
    ) -> tuple[Client, PageRegions]:
        self._check_open(keys, host_pages)
        if self._client is None or self._regions is None:
            raise self._not_attached()
        return self._client, self._regions

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        """The server-side keys of ``keys`` in the current generation."""
        assert self._regions is not None
        with self._lock:
            generation = self._generation
        prefix = f"{self.settings.namespace}.{generation:x}.{self._regions.order.tag}"
        return [key_string(prefix, key) for key in keys]

    def _read_generation(self, conn: Connection) -> int:
        conn.send([encode_request(Command.GET, self._control_key)])
        return self._read_generation_reply(conn)

    @staticmethod
    def _read_generation_reply(conn: Connection) -> int:
        reply = conn.read_reply()
        if reply.ok and reply.value_bytes == _GENERATION_BYTES:
            value = bytearray(_GENERATION_BYTES)
            conn.read_into([value])
            return int.from_bytes(value, "little")
        conn.discard(reply.value_bytes)
        return 0  # never cleared (or an unreadable control value: start over at 0)

    def _set_generation(self, generation: int) -> bool:
        """Adopt ``generation``; True if it changed."""
        with self._lock:
            changed = generation != self._generation
            self._generation = generation
            if changed:
                self._bad.clear()
        return changed

    def _count_error(self, error: BaseException, pages: int) -> None:
        if isinstance(error, ConnectionError):  # refused, reset, closed, or ServerUnreachable
            reason = FailureReason.UNREACHABLE
        elif isinstance(error, TimeoutError):
            reason = FailureReason.TIMEOUT
        else:
            reason = FailureReason.IO_ERROR
        self._fail(reason, pages)

    def _drop(self, keys: Sequence[bytes]) -> None:
        """lmcache_server cannot delete: this instance remembers the pages as bad (missing
        until it stores them anew) and overwrites each with a one-byte tombstone, which
        any other instance reads as a short page, a miss."""
        client, _ = self._ready(keys)
        names = self._names(keys)
        self._remember_bad(names)
        try:
            with client.connection() as conn:
                conn.put(((name, [_TOMBSTONE]) for name in names), self._control_key)
        except (OSError, ProtocolError) as error:
            self._count_error(error, 1)

    def _mark_bad(self, name: str, fault: Fault) -> None:
        self._fail(fault)
        self._remember_bad([name])

    def _remember_bad(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                self._bad[name] = None
                self._bad.move_to_end(name)
            while len(self._bad) > BAD_KEYS_REMEMBERED:
                self._bad.popitem(last=False)

    def _forget_bad(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                self._bad.pop(name, None)

    def _bad_snapshot(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._bad)

