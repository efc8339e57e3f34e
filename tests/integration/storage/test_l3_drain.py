"""The drain to L3 (``cache/drain.py``) on a real file store: every device and host page L3
lacks ends in L3, hottest first, and a new cache on the store reuses it (the KV oracle checks
every hit equals cold KV); bounded by a deadline, what landed by then is whole and the
hottest prefixes' pages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache.cache.drain import DrainProgress, L3Drain, pages_lacking
from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.memory.geometry import KVGeometry
from hicache.radix.keys import chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.config import PrefetchPolicy, StorageConfig
from hicache.storage.controller import BackupOp
from tests.kv_oracle import conversation, serve, serve_with_l3, settle
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
PAGE_SIZE = 4
TOKENS = 32  # 8 pages a conversation


def make_cache(
    backend: str, extra: dict[str, Any], *, policy: WritePolicy = WritePolicy.WRITE_BACK,
    storage: bool = True,
) -> HierarchicalCache:
    """write_back by default: nothing reaches L2 or L3 until evicted, so L3 lacks it all."""
    config = CacheConfig(
        page_size=PAGE_SIZE, enable_hierarchical_cache=True, write_policy=policy,
        io_backend=IOBackendKind.DIRECT, mem_layout=MemLayout.PAGE_FIRST,
        load_back_threshold_tokens=1,
    )
    l3 = StorageConfig(
        backend=backend, backend_extra=extra, prefetch_threshold=1,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
    )
    return HierarchicalCache(config, GEOMETRY, 64, storage=l3 if storage else None)


def l3_config(path: Path) -> StorageConfig:
    return StorageConfig(backend="file", backend_extra={"path": str(path)})


def keys_of(cache: HierarchicalCache, tokens: list[int]) -> list[bytes]:
    return chain_page_keys(pack_tokens(tokens), PAGE_SIZE, cache.tree.seed(None))


def record_backups(cache: HierarchicalCache) -> list[bytes]:
    """The page keys of every L3 write, in the order they reach the write thread."""
    assert cache.storage is not None
    controller = cache.storage.controller
    submitted: list[bytes] = []
    submit = controller.submit_backup

    def recording(op: BackupOp) -> None:
        submitted.extend(op.keys)
        submit(op)

    controller.submit_backup = recording  # type: ignore[method-assign]
    return submitted


def drain(
    cache: HierarchicalCache, until: Callable[[DrainProgress], bool] = lambda p: p.done
) -> DrainProgress:
    """Step a drain as the engine does between scheduler ticks, until ``until`` holds."""
    job = L3Drain(cache)
    last = [job.step()]

    def reached() -> bool:
        cache.poll()
        last[0] = job.step()
        return until(last[0])

    assert wait_until(reached), f"the drain never got there: {last[0]}"
    return last[0]


def test_every_page_l3_lacks_is_written_hottest_first(tmp_path: Path) -> None:
    extra = {"path": str(tmp_path / "l3")}
    cache = make_cache("file", extra)
    convs = [conversation(TOKENS, seed=i) for i in range(4)]
    for tokens in convs:
        serve(cache, tokens)
    serve(cache, convs[1])  # used again: now the hottest
    settle(cache)
    assert cache.storage is not None
    backend = cache.storage.backend
    assert isinstance(backend, FileBackend) and backend.stats().pages_written == 0
    assert pages_lacking(cache) == 4 * TOKENS // PAGE_SIZE
    submitted = record_backups(cache)

    progress = drain(cache)

    assert progress.done and progress.pages_to_write == 4 * TOKENS // PAGE_SIZE
    assert progress.pages_written == progress.pages_to_write and progress.pages_skipped == 0
    hottest_first = [convs[1], convs[3], convs[2], convs[0]]
    assert submitted == [key for tokens in hottest_first for key in keys_of(cache, tokens)]
    for tokens in convs:
        keys = keys_of(cache, tokens)
        assert backend.exists(keys) == len(keys)
    settle(cache)
    assert pages_lacking(cache) == 0  # what landed is known stored: a second drain skips it
    assert drain(cache) == DrainProgress(done=True)
    cache.close()

    second = make_cache("file", extra)
    try:
        for tokens in convs:  # all from L3, equal to cold KV (the oracle checks)
            assert serve_with_l3(second, tokens) == len(tokens)
    finally:
        second.close()


def test_host_pages_l3_lacks_are_written_and_what_l3_has_is_not_rewritten(
    tmp_path: Path,
) -> None:
    # Pages reach L2 while no L3 is attached (write_through): host copies L3 lacks.
    cache = make_cache("file", {}, policy=WritePolicy.WRITE_THROUGH, storage=False)
    host_only, stored = conversation(TOKENS, seed=1), conversation(TOKENS, seed=2)
    serve(cache, host_only)
    settle(cache)
    cache.attach_storage(l3_config(tmp_path / "l3"))
    serve(cache, stored)  # written through to L3 as usual
    settle(cache)
    assert cache.storage is not None
    backend = cache.storage.backend
    assert backend.stats().pages_written == TOKENS // PAGE_SIZE
    assert cache.tree.num_host_pages == 2 * TOKENS // PAGE_SIZE
    submitted = record_backups(cache)

    progress = drain(cache)

    assert progress.done and progress.pages_written == TOKENS // PAGE_SIZE
    assert submitted == keys_of(cache, host_only)  # the stored one is known stored
    assert backend.exists(keys_of(cache, host_only)) == TOKENS // PAGE_SIZE
    settle(cache)
    cache.close()


def test_a_drain_cut_by_its_deadline_leaves_whole_pages_hottest_first(tmp_path: Path) -> None:
    # A store slow on purpose: each write call takes 200 ms (one per conversation); the
    # deadline passes once the first has landed (the caller stops stepping, the worker exits).
    path = tmp_path / "l3"
    extra = {"backend": "file", "backend_extra": {"path": str(path)}, "write_latency_ms": 200}
    cache = make_cache("throttled", extra)
    convs = [conversation(TOKENS, seed=i) for i in range(4)]
    for tokens in convs:
        serve(cache, tokens)
    settle(cache)

    progress = drain(cache, until=lambda p: p.pages_written > 0)

    assert not progress.done
    assert 0 < progress.pages_written < progress.pages_to_write
    cache.close()  # the exit: in-flight writes end by their deadline, queued ones dropped
    after = make_cache("file", {"path": str(path)})  # a new worker on the store
    try:
        assert after.storage is not None
        store = after.storage.backend
        stored = [store.exists(keys_of(after, tokens)) for tokens in reversed(convs)]
        pages = TOKENS // PAGE_SIZE
        # Hottest first: the last conversation served was written first; each one whole
        # or absent (a page is visible only once complete: the file store's atomic put).
        assert stored[0] == pages
        assert all(n in (0, pages) for n in stored)
        assert stored == sorted(stored, reverse=True)
        assert isinstance(store, FileBackend)
        store.check_integrity()
    finally:
        after.close()
