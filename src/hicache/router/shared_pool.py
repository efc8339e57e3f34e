"""Lookups of the shared L3 pool: which of a request's pages it holds.

The workers name a page in L3 by its namespaced chain key
(``radix.keys.chain_page_keys`` from the worker's ``KeyNamespace`` seed, which
a worker reports in /get_server_info as ``hicache_l3_key_seed``) plus the row
order of its host layout (``storage.frame.object_name``: the key in hex, then
"lm" or "tm"). A lookup computes the same names from the request's token ids
and asks the pool, ``MAX_BATCH_PAGES`` names per query as the cache does:

- ``FileSharedPool``: the ``file`` backend's directory that the workers of one
  machine share; a page is there when its file is (``<root>/<2 hex>/<name>``).
- ``MooncakeSharedPool``: a Mooncake client that lends no memory of its own,
  asking the master ``batch_is_exist``.
- ``InMemorySharedPool``: a set of page hashes (tests, the decision benchmark).

``shared_pool_for_worker`` builds the right one from a worker's /get_server_info.

The blocking ones (file, Mooncake) answer on one lookup thread of their own, so the
router's event loop never waits on storage, and in batches: every query that
arrived while the thread was busy is answered by its next pass, the pages they
share asked once (``MAX_BATCH_PAGES`` names per store call). Under load decisions
come in bursts (a round of conversations answered together); a pool that took a
fixed few queries at a time refused most of a burst, and one thread per query
spent the deadline waiting for the interpreter lock. What a pass learns is kept
for the next decisions, by the router's page hash: each page's store name (its
chain key: a request extending a known prefix hashes only its new pages), and
the pages found, for ``PRESENT_TTL_S`` (a store rarely evicts; a page not found
may be written any moment, so it is asked again). A request whose every page
was found recently is answered on the event loop, without the thread; a failed
store call forgets what was found (the store may have restarted empty).

A query is refused at once (``SharedPoolError``) while the thread has been
inside one pass for ``STALLED_AFTER_S`` (a hung store cannot hold decisions or
pile up queries) or ``MAX_PENDING`` queries wait; the policy then scores from
the index alone. Invariant: ``page_hashes`` are the pages of ``token_ids``
(``events.hashing.page_hashes``): answers are remembered by page hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any, Final

from hicache.config import MemLayout
from hicache.radix.keys import KEY_BYTES, chain_page_keys, pack_tokens
from hicache.storage.backends.file.settings import default_path
from hicache.storage.backends.mooncake.settings import (
    DEFAULT_LOCAL_HOSTNAME,
    DEFAULT_METADATA_SERVER,
    MooncakeSettings,
    split_host_port,
)
from hicache.storage.base import MAX_BATCH_PAGES, StorageError
from hicache.storage.frame import PayloadOrder, object_name

# Queries waiting for the lookup thread; one more is refused at once.
MAX_PENDING: Final = 256
# A pass of the lookup thread this long means a store that stopped answering: queries are
# refused at once until it returns.
STALLED_AFTER_S: Final = 1.0
# A page found in the store is taken as there for this long without asking again.
PRESENT_TTL_S: Final = 5.0
# Pages whose store name (and when last found) is remembered; the oldest half goes past it.
MAX_REMEMBERED_PAGES: Final = 1 << 17
# After a failed Mooncake client set-up, queries fail at once for this long.
SETUP_RETRY_S: Final = 1.0
# The Mooncake client's local buffer: existence queries move no data.
_QUERY_BUFFER_BYTES: Final = 1 << 20


class SharedPoolError(RuntimeError):
    """The shared pool could not answer (unreachable, busy, or an error code)."""


def parse_key_seed(key_seed: bytes | str) -> bytes:
    """The workers' chain seed, as bytes or as the hex /get_server_info reports."""
    if isinstance(key_seed, str):
        try:
            key_seed = bytes.fromhex(key_seed)
        except ValueError:
            raise ValueError(f"key_seed must be {2 * KEY_BYTES} hex digits, got "
                             f"{key_seed!r}") from None
    if len(key_seed) != KEY_BYTES:
        raise ValueError(f"key_seed must be {KEY_BYTES} bytes, got {len(key_seed)}")
    return key_seed


class InMemorySharedPool:
    """A ``SharedPoolLookup`` over a set of page hashes, answered at once."""

    def __init__(self, page_hashes: Iterable[int] = ()) -> None:
        self.pages = set(page_hashes)
        self.num_queries = 0

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        self.num_queries += 1
        pages = self.pages
        return [page in pages for page in page_hashes]


@dataclass
class _Query:
    """One decision's question, waiting for the lookup thread."""

    page_hashes: list[int]
    token_ids: list[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[bool]]
    # Set by the lookup thread: the answer, or why there is none.
    flags: list[bool] = field(default_factory=list)
    error: BaseException | None = None


class _NamedPagePool:
    """What both real pools share: page names from token ids, the lookup thread, the
    batches and what they remember (see the module docstring)."""

    def __init__(
        self, key_seed: bytes | str, page_size: int, mem_layout: MemLayout | str,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.key_seed = parse_key_seed(key_seed)
        self.page_size = page_size
        try:
            layout = MemLayout(mem_layout)
        except ValueError:
            layouts = ", ".join(m.value for m in MemLayout)
            raise ValueError(f"mem_layout must be the workers' hicache_mem_layout, one of "
                             f"{layouts}; got {mem_layout!r}") from None
        self.order = PayloadOrder.of_layout(layout)
        self._cond = threading.Condition()
        self._pending: list[_Query] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pass_began: float | None = None  # while the thread answers a batch
        # By page hash: its chain key and store name (fixed by the seed and the tokens),
        # the lookup thread's own; and when the page was last found in the store, written
        # by the lookup thread only (under _cond: the event loop reads it).
        self._names: dict[int, tuple[bytes, str]] = {}
        self._found_at: dict[int, float] = {}
        self.num_passes = 0  # batches answered (or failed) by the thread
        self.num_store_pages = 0  # pages asked of the store itself

    def page_names(self, num_pages: int, token_ids: Sequence[int]) -> list[str]:
        """Store names of the first ``num_pages`` pages of ``token_ids``."""
        self._check_length(num_pages, token_ids)
        data = pack_tokens(list(token_ids[:num_pages * self.page_size]))
        keys = chain_page_keys(data, self.page_size, self.key_seed)
        return [object_name(key, self.order) for key in keys]

    def _check_length(self, num_pages: int, token_ids: Sequence[int]) -> None:
        num_tokens = num_pages * self.page_size
        if len(token_ids) < num_tokens:
            raise ValueError(f"{num_pages} pages of {self.page_size} tokens need "
                             f"{num_tokens} token ids, got {len(token_ids)}")

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        """One flag per page of ``page_hashes`` (the request's full pages); raises
        ``SharedPoolError`` when the pool cannot answer."""
        return await self.submit(page_hashes, token_ids)

    def submit(self, page_hashes: Sequence[int], token_ids: Sequence[int],
               ) -> asyncio.Future[list[bool]]:
        """``hits`` started at once, without a task: the query is with the lookup thread
        (or answered) when this returns, so the caller's own work overlaps it. Raises
        ``SharedPoolError`` when the query is refused. Call on the event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[bool]] = loop.create_future()
        if not page_hashes:
            future.set_result([])
            return future
        self._check_length(len(page_hashes), token_ids)
        hashes = list(page_hashes)
        with self._cond:
            if self._closed:
                raise SharedPoolError("the shared pool lookup is closed")
            now = time.monotonic()
            if self._all_found(hashes, now):
                future.set_result([True] * len(hashes))
                return future
            began = self._pass_began
            if began is not None and now - began > STALLED_AFTER_S:
                raise SharedPoolError(f"the shared pool has not answered for "
                                      f"{now - began:.1f} s: it is not answering")
            if len(self._pending) >= MAX_PENDING:
                raise SharedPoolError(f"{MAX_PENDING} shared pool queries waiting: the pool "
                                      "is not answering")
            tokens = list(token_ids[:len(hashes) * self.page_size])
            # A caller that stops waiting (the policy's deadline) cancels only its wait: the
            # pass goes on, and what it finds serves the next decisions.
            self._pending.append(_Query(hashes, tokens, loop, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hicache-shared",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def _all_found(self, page_hashes: Sequence[int], now: float) -> bool:
        found_at = self._found_at
        for page in page_hashes:
            at = found_at.get(page)
            if at is None or now - at > PRESENT_TTL_S:
                return False
        return True

    # ------------------------------------------------------------ the thread
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                batch, self._pending = self._pending, []
                if self._closed:
                    error = SharedPoolError("the shared pool lookup is closed")
                    for query in batch:
                        query.error = error
                    _settle(batch)
                    return
                self._pass_began = time.monotonic()
            try:
                self._answer(batch)
            except Exception as error:  # a bug here must not end the thread: fail the batch
                failure = SharedPoolError(f"the shared pool lookup failed: "
                                          f"{type(error).__name__}: {error}")
                for query in batch:
                    query.error = failure
            finally:
                with self._cond:
                    self._pass_began = None
                    self.num_passes += 1
            _settle(batch)

    def _answer(self, batch: list[_Query]) -> None:
        """Each query's flags (or error): the pages not found lately asked of the store,
        each name once for the whole batch."""
        now = time.monotonic()
        names: list[list[str]] = []
        ask: dict[str, int] = {}  # store name -> page hash, in the order first needed
        found_at = self._found_at  # read without the lock: only this thread writes it
        for query in batch:
            try:
                query_names = self._query_names(query)
            except Exception as error:  # token ids that cannot be packed: this query's own
                query.error = SharedPoolError(f"cannot name the request's pages: {error}")
                names.append([])
                continue
            names.append(query_names)
            for page, name in zip(query.page_hashes, query_names, strict=True):
                at = found_at.get(page)
                if (at is None or now - at > PRESENT_TTL_S) and name not in ask:
                    ask[name] = page
        asked = list(ask)
        present: dict[str, bool] = {}
        try:
            for start in range(0, len(asked), MAX_BATCH_PAGES):
                chunk = asked[start:start + MAX_BATCH_PAGES]
                present.update(zip(chunk, self._exist(chunk), strict=True))
        except Exception as error:  # the store's failure is every query's
            with self._cond:
                self._found_at.clear()  # it may have restarted empty
            failure = error if isinstance(error, SharedPoolError) else SharedPoolError(
                f"the shared pool lookup failed: {type(error).__name__}: {error}")
            for query in batch:
                query.error = failure
            return
        self.num_store_pages += len(asked)
        with self._cond:
            for name, page in ask.items():
                if present[name]:
                    self._found_at[page] = now
            _forget_oldest(self._found_at)
        for query, query_names in zip(batch, names, strict=True):
            # A name not asked was found lately: there.
            query.flags = [present.get(name, True) for name in query_names]

    def _query_names(self, query: _Query) -> list[str]:
        """The store names of a query's pages: the known prefix's remembered, the rest
        chained on from its last key."""
        remembered = self._names
        hashes = query.page_hashes
        known = [remembered[page] for page in
                 itertools.takewhile(lambda page: page in remembered, hashes)]
        query_names = [name for _, name in known]
        if len(known) < len(hashes):
            start = len(known) * self.page_size
            data = pack_tokens(query.token_ids[start:len(hashes) * self.page_size])
            previous = known[-1][0] if known else self.key_seed
            keys = chain_page_keys(data, self.page_size, previous)
            for page, key in zip(hashes[len(known):], keys, strict=True):
                name = object_name(key, self.order)
                remembered[page] = (key, name)
                query_names.append(name)
            _forget_oldest(remembered)
        return query_names

    def _exist(self, names: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def _forget_oldest(remembered: dict[int, Any]) -> None:
    """Past ``MAX_REMEMBERED_PAGES``, drop the oldest half (dicts keep insertion order)."""
    if len(remembered) > MAX_REMEMBERED_PAGES:
        for page in list(itertools.islice(remembered, len(remembered) // 2)):
            del remembered[page]


def _settle(batch: Sequence[_Query]) -> None:
    """Hand each query its answer on its own event loop, one call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Query]] = {}
    for query in batch:
        by_loop.setdefault(query.loop, []).append(query)
    for loop, queries in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
            loop.call_soon_threadsafe(_resolve, queries)


def _resolve(queries: Sequence[_Query]) -> None:
    for query in queries:
        if query.future.done():  # its caller stopped waiting
            continue
        if query.error is not None:
            query.future.set_exception(query.error)
        else:
            query.future.set_result(query.flags)


class FileSharedPool(_NamedPagePool):
    """The ``file`` backend's directory shared by the workers of one machine."""

    def __init__(
        self, root_dir: str | os.PathLike[str], key_seed: bytes | str, page_size: int,
        mem_layout: MemLayout | str = MemLayout.LAYER_FIRST,
    ) -> None:
        super().__init__(key_seed, page_size, mem_layout)
        self.root = Path(root_dir).expanduser()
        self._root_text = str(self.root)

    def _exist(self, names: Sequence[str]) -> list[bool]:
        if not os.path.isdir(self._root_text):
            raise SharedPoolError(f"the shared L3 directory {self.root} does not exist")
        flags = []
        for name in names:
            try:
                info = os.stat(f"{self._root_text}/{name[:2]}/{name}")
            except FileNotFoundError:
                flags.append(False)
                continue
            except OSError as error:
                raise SharedPoolError(f"cannot read the shared L3 directory: {error}") from error
            flags.append(S_ISREG(info.st_mode))  # as the backend: a directory is no page
        return flags


class MooncakeSharedPool(_NamedPagePool):
    """The Mooncake Store the workers share, asked through a client of our own
    that lends it no memory (set up on the first query, in a pool thread)."""

    def __init__(
        self, master_address: str, key_seed: bytes | str, page_size: int,
        mem_layout: MemLayout | str = MemLayout.LAYER_FIRST, *,
        metadata_server: str = DEFAULT_METADATA_SERVER, protocol: str = "tcp",
        local_hostname: str = DEFAULT_LOCAL_HOSTNAME, device_name: str = "",
    ) -> None:
        super().__init__(key_seed, page_size, mem_layout)
        try:
            split_host_port(master_address, "master_address")
        except StorageError as error:
            raise ValueError(str(error)) from None
        self.settings = MooncakeSettings(
            master_address, metadata_server, protocol, local_hostname,
            global_segment_size=0, local_buffer_size=_QUERY_BUFFER_BYTES,
            device_name=device_name,
        )
        self._client: Any = None  # a mooncake.client.MooncakeClient once set up
        self._setup_failed_at = -float("inf")
        self._setup_lock = threading.Lock()

    def _exist(self, names: Sequence[str]) -> list[bool]:
        client = self._ready_client()
        if not client.usable():
            raise SharedPoolError(
                f"the mooncake master {self.settings.master_server_address} is not answering"
            )
        codes = [int(code) for code in client.store.batch_is_exist(list(names))]
        client.saw_codes(codes)
        errors = sorted({code for code in codes if code < 0})
        if errors:
            raise SharedPoolError(f"mooncake batch_is_exist answered error codes {errors}")
        return [code == 1 for code in codes]

    def _ready_client(self) -> Any:
        with self._setup_lock:
            if self._client is not None:
                return self._client
            address = self.settings.master_server_address
            if time.monotonic() - self._setup_failed_at < SETUP_RETRY_S:
                raise SharedPoolError(f"no client for the mooncake master {address} (set-up "
                                      "failed less than a second ago)")
            try:
                # Imported here: the router runs without the mooncake package unless asked.
                from hicache.storage.backends.mooncake.client import acquire_client

                self._client = acquire_client(self.settings)
            except (ImportError, StorageError) as error:
                self._setup_failed_at = time.monotonic()
                raise SharedPoolError(f"no client for the mooncake master {address}: "
                                      f"{error}") from error
            return self._client

    def close(self) -> None:
        super().close()
        with self._setup_lock:
            client, self._client = self._client, None
        if client is not None:
            from hicache.storage.backends.mooncake.client import release_client

            release_client(client)


def shared_pool_for_worker(server_info: Mapping[str, Any]) -> FileSharedPool | MooncakeSharedPool:
    """The lookup of the L3 a worker uses, from its /get_server_info: the backend
    and its extra config, ``page_size``, ``hicache_mem_layout`` and
    ``hicache_l3_key_seed``. Raises ValueError naming what is missing or not shared."""
    backend = server_info.get("hicache_storage_backend")
    seed = server_info.get("hicache_l3_key_seed")
    page_size = server_info.get("page_size")
    layout = server_info.get("hicache_mem_layout") or MemLayout.LAYER_FIRST.value
    if backend not in ("file", "mooncake"):
        raise ValueError(f"the worker's L3 backend is {backend!r}: a shared pool lookup needs "
                         "'file' or 'mooncake'")
    if not isinstance(seed, str):
        raise ValueError("the worker does not report hicache_l3_key_seed: its L3 page names "
                         "cannot be computed")
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise ValueError(f"the worker reports no usable page_size ({page_size!r})")
    text = server_info.get("hicache_storage_backend_extra_config")
    try:
        extra = json.loads(text) if isinstance(text, str) and text else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"the worker's hicache_storage_backend_extra_config is not JSON: "
                         f"{error}") from None
    if not isinstance(extra, Mapping):
        raise ValueError("the worker's hicache_storage_backend_extra_config is not an object")
    if backend == "file":
        # The worker's default directory is the local cache dir, as it is here.
        return FileSharedPool(extra.get("path") or default_path(), seed, page_size, layout)
    master = extra.get("master_server_address")
    if not isinstance(master, str):
        raise ValueError("the worker's mooncake config names no master_server_address (set "
                         "from its environment?): pass the master to the router")
    return MooncakeSharedPool(
        master, seed, page_size, layout,
        metadata_server=extra.get("metadata_server") or DEFAULT_METADATA_SERVER,
        protocol=extra.get("protocol") or "tcp",
    )
