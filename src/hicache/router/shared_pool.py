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

The blocking ones work on a small thread pool of their own, so the router's
event loop never waits on storage, and refuse a query outright while
``MAX_IN_FLIGHT`` are still running (a hung pool cannot pile up threads): the
policy's deadline then scores from the index alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from stat import S_ISREG
from typing import Any, Final

from hicache.config import MemLayout
from hicache.radix.keys import KEY_BYTES, chain_page_keys, pack_tokens
from hicache.storage.base import MAX_BATCH_PAGES, StorageError
from hicache.storage.file import default_path
from hicache.storage.frame import PayloadOrder, object_name
from hicache.storage.mooncake_settings import (
    DEFAULT_LOCAL_HOSTNAME,
    DEFAULT_METADATA_SERVER,
    MooncakeSettings,
    split_host_port,
)

# Queries a pool runs at once; one more is refused at once.
MAX_IN_FLIGHT: Final = 4
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


class _NamedPagePool:
    """What both real pools share: page names from token ids, batching, the threads."""

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
        self._executor = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="hicache-shared")
        self._in_flight = 0
        self._lock = threading.Lock()

    def page_names(self, num_pages: int, token_ids: Sequence[int]) -> list[str]:
        """Store names of the first ``num_pages`` pages of ``token_ids``."""
        num_tokens = num_pages * self.page_size
        if len(token_ids) < num_tokens:
            raise ValueError(f"{num_pages} pages of {self.page_size} tokens need "
                             f"{num_tokens} token ids, got {len(token_ids)}")
        data = pack_tokens(list(token_ids[:num_tokens]))
        keys = chain_page_keys(data, self.page_size, self.key_seed)
        return [object_name(key, self.order) for key in keys]

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        """One flag per page of ``page_hashes`` (the request's full pages); raises
        ``SharedPoolError`` when the pool cannot answer."""
        if not page_hashes:
            return []
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                raise SharedPoolError(
                    f"{MAX_IN_FLIGHT} shared pool queries still running: the pool is not answering"
                )
            self._in_flight += 1
        # A caller that stops waiting (the policy's deadline) leaves the thread running:
        # the count drops when the thread is done, not when the caller is.
        try:
            work = self._executor.submit(self._counted, len(page_hashes), list(token_ids))
        except RuntimeError as error:  # shut down
            with self._lock:
                self._in_flight -= 1
            raise SharedPoolError(f"the shared pool lookup is closed: {error}") from error
        return await asyncio.wrap_future(work)

    def _counted(self, num_pages: int, token_ids: Sequence[int]) -> list[bool]:
        try:
            return self.hits_blocking(num_pages, token_ids)
        finally:
            with self._lock:
                self._in_flight -= 1

    def hits_blocking(self, num_pages: int, token_ids: Sequence[int]) -> list[bool]:
        names = self.page_names(num_pages, token_ids)
        flags: list[bool] = []
        for start in range(0, len(names), MAX_BATCH_PAGES):
            flags += self._exist(names[start:start + MAX_BATCH_PAGES])
        return flags

    def _exist(self, names: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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
        self._client: Any = None  # a mooncake_client.MooncakeClient once set up
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
                from hicache.storage.mooncake_client import acquire_client

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
            from hicache.storage.mooncake_client import release_client

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
