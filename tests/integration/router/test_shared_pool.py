"""FileSharedPool against a file L3 written by a real cache; the policy without the pool."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, IOBackendKind, MemLayout, WritePolicy
from hicache.events.hashing import page_hashes
from hicache.memory.geometry import KVGeometry
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, TierAwarePolicy, build_policy
from hicache.router.shared_pool import (
    FileSharedPool,
    MooncakeSharedPool,
    SharedPoolError,
    parse_key_seed,
    shared_pool_for_worker,
)
from hicache.router.types import RouteRequest, WorkerLoad
from hicache.storage.config import PrefetchPolicy, StorageConfig
from hicache.storage.frame import PayloadOrder
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import running_router
from tests.waiting import wait_until_async

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
PAGE = 4
LAYOUT = MemLayout.PAGE_FIRST


def file_cache(root: Path) -> HierarchicalCache:
    """A write-through cache backing up to a file L3 in ``root``, as a worker's."""
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, write_policy=WritePolicy.WRITE_THROUGH,
        io_backend=IOBackendKind.DIRECT, mem_layout=LAYOUT, load_back_threshold_tokens=1,
    )
    storage = StorageConfig(backend="file", backend_extra={"path": str(root)},
                            prefetch_threshold=1, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = HierarchicalCache(config, GEOMETRY, 64, storage=storage)
    assert cache.storage is not None, cache.storage_error
    return cache


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bytes]]:
    """A file L3 holding the 10 pages of ``conversation(40)``, and the worker's key seed."""
    root = tmp_path_factory.mktemp("l3")
    cache = file_cache(root)
    try:
        serve_with_l3(cache, conversation(40))
        settle(cache)
        assert cache.stats.num_storage_backed_up_pages == 10
        yield root, cache.tree.seed(None)
    finally:
        cache.close()


def ask(pool: FileSharedPool, tokens: Sequence[int]) -> list[bool]:
    return asyncio.run(pool.hits(page_hashes(tokens, PAGE), tokens))


def test_the_pool_finds_the_pages_a_worker_backed_up(written: tuple[Path, bytes]) -> None:
    root, seed = written
    pool = FileSharedPool(root, seed.hex(), PAGE, LAYOUT)  # the seed as /get_server_info says it
    try:
        # 60 tokens: the 10 backed-up pages, then 5 nobody wrote.
        tokens = conversation(40) + [7] * 20
        assert ask(pool, tokens) == [True] * 10 + [False] * 5
        # Another prompt, and the same prompt in another namespace or row order, are not there.
        assert ask(pool, conversation(40, seed=3)) == [False] * 10
        other_seed = FileSharedPool(root, bytes(16), PAGE, LAYOUT)
        other_order = FileSharedPool(root, seed, PAGE, MemLayout.LAYER_FIRST)
        assert ask(other_seed, tokens[:40]) == [False] * 10
        assert ask(other_order, tokens[:40]) == [False] * 10
        other_seed.close()
        other_order.close()
        # A partial last page has no hash and no L3 object: only full pages are asked.
        assert ask(pool, tokens[:42]) == [True] * 10
        assert ask(pool, []) == []
    finally:
        pool.close()


def test_tier_aware_routes_to_a_worker_that_can_fetch_from_l3(
    written: tuple[Path, bytes],
) -> None:
    root, seed = written
    tokens = conversation(40)
    hashes = page_hashes(tokens, PAGE)
    index = PageIndex()  # no events: only the shared pool knows the prefix
    pool = FileSharedPool(root, seed, PAGE, LAYOUT)
    # A deadline no loaded test machine misses: this test is about the answer, not its time.
    config = ScoringConfig(shared_cache_multiplier=0.5, shared_deadline_s=5.0)
    policy = build_policy("tier_aware", index, pool, config)
    request = RouteRequest(page_hashes=hashes, prompt_tokens=40, page_size=PAGE,
                           workers=[WorkerLoad("a", 1, 1.0), WorkerLoad("b", 1, 0.0)])
    try:
        decision = asyncio.run(policy.choose(request, tokens))
    finally:
        pool.close()
    assert decision.shared_hits == 10
    assert decision.shared_beyond == 10
    # 10 pages, half saved by L3: 5 + decode blocks.
    assert decision.logits == {"a": 6.0, "b": 5.0}
    assert decision.worker == "b"


def test_a_missing_directory_fails_and_the_policy_scores_without_it(tmp_path: Path) -> None:
    pool = FileSharedPool(tmp_path / "absent", bytes(16), PAGE)
    tokens = conversation(16)
    try:
        with pytest.raises(SharedPoolError, match="does not exist"):
            ask(pool, tokens)
        policy = build_policy("tier_aware", PageIndex(), pool, ScoringConfig())
        request = RouteRequest(page_hashes=page_hashes(tokens, PAGE), prompt_tokens=16,
                               page_size=PAGE, workers=[WorkerLoad("a")])
        decision = asyncio.run(policy.choose(request, tokens))
    finally:
        pool.close()
    assert decision.worker == "a"
    assert decision.shared_hits is None


class BlockedPool(FileSharedPool):
    """A real file pool whose store calls wait for ``release``: a pool that stopped
    answering (``entered`` is set once a call is inside)."""

    def __init__(self, root: Path, seed: bytes = bytes(16)) -> None:
        super().__init__(root, seed, PAGE, LAYOUT)
        self.release = threading.Event()
        self.entered = threading.Event()

    def _exist(self, names: Sequence[str]) -> list[bool]:
        self.entered.set()
        assert self.release.wait(60.0)
        return super()._exist(names)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    assert await wait_until_async(condition, timeout_s), what


def test_a_hung_pool_is_refused_at_once_until_it_answers_again(tmp_path: Path) -> None:
    pool = BlockedPool(tmp_path)
    tokens = conversation(8)
    hashes = page_hashes(tokens, PAGE)

    async def scenario() -> None:
        first = pool.submit(hashes, tokens)
        await _until(pool.entered.is_set, "the store was never asked")
        waiting = pool.submit(hashes, tokens)  # queued behind the hung call
        # Once the call has hung for STALLED_AFTER_S, a query is refused at once.

        def refused() -> bool:
            try:
                pool.submit(hashes, tokens).cancel()
            except SharedPoolError as error:
                assert "not answering" in str(error)
                return True
            return False

        assert await wait_until_async(refused, 30.0, poll_s=0.05), "a hung pool kept taking queries"
        assert not first.done() and not waiting.done()
        pool.release.set()
        assert await asyncio.wait_for(first, 30.0) == [False, False]
        assert await asyncio.wait_for(waiting, 30.0) == [False, False]
        assert await pool.hits(hashes, tokens) == [False, False]

    try:
        asyncio.run(scenario())
    finally:
        pool.release.set()
        pool.close()


def test_a_burst_of_queries_is_answered_in_one_pass_not_refused(
    written: tuple[Path, bytes],
) -> None:
    """While a pass is inside the store, 63 more decisions ask about the same conversation
    (more than any fixed number of queries at once): all are answered, by one more pass
    that asks the store each page not found yet once."""
    root, seed = written
    pool = BlockedPool(root, seed)
    tokens = conversation(40) + [7] * 20  # 10 pages in the store, then 5 nobody wrote
    hashes = page_hashes(tokens, PAGE)

    async def scenario() -> list[list[bool]]:
        first = pool.submit(hashes, tokens)
        await _until(pool.entered.is_set, "the store was never asked")
        burst = [pool.hits(hashes, tokens) for _ in range(63)]
        tasks = [asyncio.ensure_future(query) for query in burst]
        # One turn of the event loop, not a time: each task runs until it waits on the
        # pass inside the store, so every one of them is waiting now.
        await asyncio.sleep(0)
        pool.release.set()
        return [await asyncio.wait_for(first, 30.0), *await asyncio.gather(*tasks)]

    try:
        answers = asyncio.run(scenario())
    finally:
        pool.release.set()
        pool.close()
    assert answers == [[True] * 10 + [False] * 5] * 64
    # Pass 1: 15 pages; pass 2: the 5 not found (the 10 found are remembered).
    assert pool.num_passes == 2
    assert pool.num_store_pages == 15 + 5


def test_pages_found_are_remembered_and_a_longer_prompt_asks_only_its_new_pages(
    written: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, seed = written
    pool = FileSharedPool(root, seed, PAGE, LAYOUT)
    tokens = conversation(40)
    hashes = page_hashes(tokens, PAGE)

    async def scenario() -> None:
        assert await pool.hits(hashes[:6], tokens) == [True] * 6
        assert pool.num_store_pages == 6
        # Every page found lately: answered on the spot, the store not asked.
        query = pool.submit(hashes[:6], tokens)
        assert query.done() and query.result() == [True] * 6
        # A longer prompt on the same prefix: its 4 new pages are asked, and named from
        # the remembered chain (the same names as from scratch, or it would not find them).
        assert await pool.hits(hashes, tokens) == [True] * 10
        assert (pool.num_passes, pool.num_store_pages) == (2, 10)
        # Past PRESENT_TTL_S a page found is asked again (the store may have evicted it).
        monkeypatch.setattr("hicache.router.shared_pool.PRESENT_TTL_S", 0.0)
        assert await pool.hits(hashes, tokens) == [True] * 10
        assert (pool.num_passes, pool.num_store_pages) == (3, 20)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_a_failed_store_call_forgets_what_was_found(tmp_path: Path) -> None:
    """A store that failed may come back empty: pages found before are asked again."""
    root = tmp_path / "l3"
    cache = file_cache(root)
    try:
        serve_with_l3(cache, conversation(40))
        settle(cache)
        seed = cache.tree.seed(None)
    finally:
        cache.close()
    pool = FileSharedPool(root, seed, PAGE, LAYOUT)
    tokens = conversation(40)
    hashes = page_hashes(tokens, PAGE)

    async def scenario() -> None:
        assert await pool.hits(hashes, tokens) == [True] * 10
        assert pool.submit(hashes, tokens).done()  # remembered
        moved = tmp_path / "moved"
        root.rename(moved)  # the store is gone
        longer = [*tokens, 1, 2, 3, 4]  # one page more, not found yet: the store is asked
        with pytest.raises(SharedPoolError, match="does not exist"):
            await pool.hits(page_hashes(longer, PAGE), longer)
        moved.rename(root)
        query = pool.submit(hashes, tokens)
        assert not query.done()  # forgotten: asked again
        assert await query == [True] * 10

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="32 hex digits"):
        parse_key_seed("not hex")
    with pytest.raises(ValueError, match="16 bytes"):
        parse_key_seed(b"short")
    with pytest.raises(ValueError, match="page_size"):
        FileSharedPool(tmp_path, bytes(16), 0)
    with pytest.raises(ValueError, match="hicache_mem_layout"):
        FileSharedPool(tmp_path, bytes(16), PAGE, "diagonal")
    pool = FileSharedPool(tmp_path, bytes(16), PAGE)
    try:
        with pytest.raises(ValueError, match="need 8 token ids"):
            asyncio.run(pool.hits([1, 2], [0, 1, 2, 3]))
    finally:
        pool.close()


def test_the_lookup_is_built_from_a_workers_server_info(
    written: tuple[Path, bytes], tmp_path: Path,
) -> None:
    root, seed = written
    info = {
        "page_size": PAGE, "hicache_mem_layout": LAYOUT.value, "hicache_l3_key_seed": seed.hex(),
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": json.dumps({"path": str(root)}),
    }
    pool = shared_pool_for_worker(info)
    assert isinstance(pool, FileSharedPool)
    try:
        assert ask(pool, conversation(40)) == [True] * 10
    finally:
        pool.close()
    mooncake = shared_pool_for_worker({
        **info, "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": json.dumps(
            {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}),
    })
    assert isinstance(mooncake, MooncakeSharedPool)
    assert mooncake.settings.master_server_address == "127.0.0.1:50051"
    assert mooncake.order is PayloadOrder.TOKEN_MAJOR
    mooncake.close()
    for broken, message in [
        ({"hicache_storage_backend": None}, "'file' or 'mooncake'"),
        ({"hicache_l3_key_seed": None}, "hicache_l3_key_seed"),
        ({"hicache_storage_backend_extra_config": "{not json"}, "not JSON"),
        ({"hicache_storage_backend": "mooncake"}, "master_server_address"),
        ({"page_size": None}, "page_size"),
    ]:
        with pytest.raises(ValueError, match=message):
            shared_pool_for_worker({**info, **broken})


def test_the_routers_metrics_count_each_query_outcome(
    written: tuple[Path, bytes], tmp_path: Path,
) -> None:
    """Through a real router: a query the file L3 answers, one whose store hangs past the
    deadline, one whose store directory is gone."""
    root, seed = written
    answering = FileSharedPool(root, seed, PAGE, LAYOUT)
    hung = BlockedPool(root, seed)
    missing = FileSharedPool(tmp_path / "absent", seed, PAGE, LAYOUT)
    # A deadline no loaded machine misses for the answered query; a short one for the hung.
    patient = ScoringConfig(shared_cache_multiplier=0.5, shared_deadline_s=30.0)
    policy = build_policy("tier_aware", PageIndex(), answering, patient)
    assert isinstance(policy, TierAwarePolicy)
    tokens = conversation(40)
    try:
        with fake_workers(FakeWorker()) as urls, running_router(urls, policy=policy) as router:
            def route() -> None:
                assert router.post("/generate", json={"input_ids": tokens}).status_code == 200

            route()
            policy.shared = missing
            route()
            policy.shared = hung
            policy.config = dataclasses.replace(patient, shared_deadline_s=0.05)
            route()
            metrics = router.get("/metrics").text
    finally:
        hung.release.set()
        for pool in (answering, hung, missing):
            pool.close()
    for outcome in ("answered", "failed", "late"):
        assert f'router_shared_cache_queries_total{{outcome="{outcome}"}} 1.0' in metrics
    assert "router_shared_cache_hit_rate_count 1.0" in metrics  # only the answer is scored
