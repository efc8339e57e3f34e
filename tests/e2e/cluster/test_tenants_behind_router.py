"""Tenants end to end: ``hicache router`` with ``--api-keys`` in front of two tiny
``hicache serve`` workers with the same key file, sharing a file L3, publishing KV events.

A request without a key is refused at the router. Tenant acme's prompt, once on one
worker (its events in the router's index), is routed back there and hits; tenant
globex's identical prompt through the same router is cold wherever it lands (0 cached
tokens) and answers the same tokens: cached equals cold, per tenant. Through the shared
L3, the other worker serves acme its pages from storage and globex none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.bench.cluster import Cluster, ClusterConfig, L3Kind, RouterConfig, wait_for
from hicache.bench.scrape import scrape
from hicache.tenancy.identity import key_digest

PAGE = 16
KEY_A, KEY_B = "acme-secret", "globex-secret"
# Starting the cluster, a request, an event: guards against a hang on a busy machine.
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("tenants")
    keys = run_dir / "keys.txt"
    keys.write_text(f"{key_digest(KEY_A)} acme\nplain:{KEY_B} globex\n")
    worker_args = (
        "--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
        "--page-size", str(PAGE), "--num-threads", "1", "--hicache-reuse-policy", "load",
        "--hicache-storage-prefetch-policy", "wait_complete", "--api-keys", str(keys),
    )
    config = ClusterConfig(
        run_dir, num_workers=2, worker_args=worker_args, max_total_tokens=1024,
        hicache_ratio=2.0, l3=L3Kind.FILE, l3_extra={"prefetch_threshold": PAGE},
        kv_events=True, startup_timeout_s=TIMEOUT_S,
        router=RouterConfig("cache_aware", ("--api-keys", str(keys),
                                            "--health-interval", "0.5")),
    )
    with Cluster(config) as running:
        assert wait_for(lambda: scrape(running.url).total("router_worker_up") == 2, TIMEOUT_S)
        yield running


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 250 + 1 for i in range(num_tokens)]


def generate(url: str, ids: list[int], key: str) -> dict[str, Any]:
    reply = httpx.post(f"{url}/generate", timeout=TIMEOUT_S,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"input_ids": ids,
                             "sampling_params": {"max_new_tokens": 3, "ignore_eos": True,
                                                 "temperature": 0}})
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def served(cluster: Cluster) -> dict[str, float]:
    return {w.url: scrape(w.url).total("hicache_requests_total") for w in cluster.workers}


def test_a_request_without_a_key_is_refused_at_the_router(cluster: Cluster) -> None:
    before = served(cluster)
    reply = httpx.post(f"{cluster.url}/generate", timeout=TIMEOUT_S,
                       json={"input_ids": prompt(0, PAGE)})
    assert reply.status_code == 401
    assert "Authorization: Bearer <key>" in reply.json()["error"]["message"]
    assert served(cluster) == before


def test_tenants_identical_prompts_stay_apart_behind_the_router(cluster: Cluster) -> None:
    owner = cluster.workers[1]
    ids = prompt(1, 6 * PAGE + 3)  # six whole pages, the last tokens computed anyway
    indexed = scrape(cluster.url).total("router_indexed_pages")
    cold_a = generate(owner.url, ids, KEY_A)
    assert cold_a["meta_info"]["cached_tokens"] == 0
    # acme's pages reached the router's index through owner's events.
    assert wait_for(lambda: scrape(cluster.url).total("router_indexed_pages") >= indexed + 6,
                    TIMEOUT_S), cluster.router.log_tail() if cluster.router else ""

    before = served(cluster)
    warm_a = generate(cluster.url, ids, KEY_A)
    after = served(cluster)
    assert [url for url in after if after[url] > before[url]] == [owner.url]
    assert warm_a["meta_info"]["cached_tokens"] == 6 * PAGE
    assert warm_a["output_ids"] == cold_a["output_ids"]

    cold_b = generate(cluster.url, ids, KEY_B)
    assert cold_b["meta_info"]["cached_tokens"] == 0, cold_b["meta_info"]
    assert cold_b["output_ids"] == cold_a["output_ids"]


def test_the_shared_l3_serves_a_tenant_its_own_pages_only(cluster: Cluster) -> None:
    writer, reader = cluster.workers
    ids = prompt(2, 6 * PAGE + 3)
    stored = scrape(writer.url).total("hicache_l3_backup_pages_stored_total")
    cold_a = generate(writer.url, ids, KEY_A)
    assert wait_for(lambda: scrape(writer.url).total("hicache_l3_backup_pages_stored_total")
                    >= stored + 6, TIMEOUT_S), writer.server.log_tail()
    # reader never saw the prompt: acme's pages come from writer through the file L3,
    # globex finds none of them there.
    cold_b = generate(reader.url, ids, KEY_B)
    assert cold_b["meta_info"]["cached_tokens"] == 0, cold_b["meta_info"]
    warm_a = generate(reader.url, ids, KEY_A)
    assert warm_a["meta_info"]["cached_tokens_details"]["storage"] == 6 * PAGE
    assert warm_a["output_ids"] == cold_a["output_ids"] == cold_b["output_ids"]
