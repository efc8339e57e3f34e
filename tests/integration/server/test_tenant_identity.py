"""Tenants through a real server with ``--api-keys``: who may call, and whose pages hit.

A tiny engine with L1, L2 and a file L3 (``--hicache-reuse-policy load`` and a
prefetch that waits, so hits are deterministic). Model routes refuse a missing or
unknown key with a 401 and take nothing in. Per tier, tenant A's prompt is put
there, then tenant B's identical prompt is cold (0 cached tokens) with the same
greedy output, while A's repeat is a hit from that tier. A salt B names (even A's
own name) nests under B, so it never reaches A's pages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.tenancy.identity import TenantIdentity, identity_from_flags, key_digest
from tests.server_fixtures import RunningServer, serve_in_thread

PAGE = 16
TIMEOUT = httpx.Timeout(60.0)
KEY_A, KEY_B = "key-of-acme", "key-of-globex"


def prompt(seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(6 * PAGE + 3)]


@pytest.fixture
def identity(tmp_path: Path) -> TenantIdentity:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{key_digest(KEY_A)} acme\nplain:{KEY_B} globex\n")
    return identity_from_flags(str(keys), None)


@pytest.fixture
def server(tmp_path: Path, identity: TenantIdentity) -> Iterator[RunningServer]:
    extra = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": PAGE})
    args = [
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", extra, "--hicache-reuse-policy", "load",
    ]
    with serve_in_thread(args, identity=identity) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any],
         key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=TIMEOUT)


def generate(server: RunningServer, ids: list[int], key: str, **extra: Any) -> dict[str, Any]:
    response = post(server, "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        **extra}, key)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def cached(result: dict[str, Any]) -> dict[str, int]:
    details: dict[str, int] = result["meta_info"]["cached_tokens_details"]
    assert result["meta_info"]["cached_tokens"] == sum(details.values())
    return details


def test_model_routes_need_a_known_key(server: RunningServer) -> None:
    body = {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}
    for key in (None, "not-a-key"):
        for path, payload in (("/generate", body), ("/v1/completions", {"prompt": "hi"}),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}]}),
                              ("/hicache/hints", {"hints": [{"kind": "retain",
                                                             "input_ids": [1, 2]}]})):
            refused = post(server, path, payload, key)
            assert refused.status_code == 401, (path, refused.text)
            assert "Authorization: Bearer <key>" in refused.json()["error"]["message"]
            assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert server.wait_idle()
    assert server.engine.metrics()["engine_num_requests"] == 0  # nothing ran
    models = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT,
                       headers={"Authorization": f"Bearer {KEY_B}"})
    assert models.status_code == 200


def test_a_tenants_identical_prompt_is_cold_in_every_tier(server: RunningServer) -> None:
    engine = server.engine
    # L1: A's pages on the device.
    ids = prompt(1)
    cold_a = generate(server, ids, KEY_A)
    assert cached(cold_a) == {"device": 0, "host": 0, "storage": 0}
    cold_b = generate(server, ids, KEY_B)
    assert cached(cold_b) == {"device": 0, "host": 0, "storage": 0}
    assert cold_b["output_ids"] == cold_a["output_ids"]
    warm_a = generate(server, ids, KEY_A)
    assert cached(warm_a)["device"] == 6 * PAGE
    assert warm_a["output_ids"] == cold_a["output_ids"]

    # L2: A's pages on the host only.
    ids = prompt(2)
    cold_a = generate(server, ids, KEY_A)
    assert server.wait_idle()
    assert engine.evict_device_cache() > 0
    assert cached(generate(server, ids, KEY_B))["host"] == 0
    warm_a = generate(server, ids, KEY_A)
    assert cached(warm_a) == {"device": 0, "host": 6 * PAGE, "storage": 0}
    assert warm_a["output_ids"] == cold_a["output_ids"]

    # L3: A's pages in the file store alone (L1 and L2 flushed once the backups landed).
    ids = prompt(3)
    cold_a = generate(server, ids, KEY_A)
    assert server.wait_idle()
    # Five tenant prompts of six pages went through L2 so far: all of them backed up.
    assert server.wait_until(lambda: engine.metrics()["storage_backup_pages_stored"] >= 30)
    flushed = httpx.post(f"{server.url}/flush_cache", timeout=TIMEOUT)
    assert flushed.status_code == 200, flushed.text
    cold_b = generate(server, ids, KEY_B)
    assert cached(cold_b) == {"device": 0, "host": 0, "storage": 0}
    assert cold_b["output_ids"] == cold_a["output_ids"]
    warm_a = generate(server, ids, KEY_A)
    assert cached(warm_a)["storage"] == 6 * PAGE
    assert warm_a["output_ids"] == cold_a["output_ids"]
    engine.check_integrity()


def test_a_salt_never_leaves_the_keys_tenant(server: RunningServer) -> None:
    ids = prompt(4)
    generate(server, ids, KEY_A)
    # B names A as its salt: nested under B (globex/acme), cold.
    assert cached(generate(server, ids, KEY_B, cache_salt="acme"))["device"] == 0
    # A salt and an extra key alone name one namespace: B's own, which now holds the prompt.
    assert cached(generate(server, ids, KEY_B, extra_key="acme"))["device"] == 6 * PAGE
    # A naming itself is A; A naming another salt is a namespace of A's own.
    assert cached(generate(server, ids, KEY_A, extra_key="acme"))["device"] == 6 * PAGE
    assert cached(generate(server, ids, KEY_A, cache_salt="s1"))["device"] == 0
    assert cached(generate(server, ids, KEY_A, cache_salt="s1"))["device"] == 6 * PAGE


def usage_cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    cached_tokens: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached_tokens


def test_openai_routes_run_as_the_keys_tenant(server: RunningServer) -> None:
    text = "tenancy " * 40
    completion = {"prompt": text, "max_tokens": 2, "temperature": 0}
    assert usage_cached(post(server, "/v1/completions", completion, KEY_A)) == 0
    assert usage_cached(post(server, "/v1/completions", completion, KEY_B)) == 0
    assert usage_cached(post(server, "/v1/completions", completion, KEY_A)) > 0
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0}
    assert usage_cached(post(server, "/v1/chat/completions", chat, KEY_B)) == 0
    assert usage_cached(post(server, "/v1/chat/completions", chat, KEY_A)) == 0
    assert usage_cached(post(server, "/v1/chat/completions", chat, KEY_B)) > 0


def test_a_gateway_header_names_the_tenant(tmp_path: Path) -> None:
    identity = identity_from_flags(None, "X-Tenant")
    with serve_in_thread(identity=identity) as server:
        def run(tenant: str | None) -> dict[str, int]:
            headers = {} if tenant is None else {"X-Tenant": tenant}
            response = httpx.post(f"{server.url}/generate", headers=headers, timeout=TIMEOUT,
                                  json={"input_ids": prompt(5),
                                        "sampling_params": {"max_new_tokens": 2}})
            assert response.status_code == 200, response.text
            return cached(response.json())
        assert run("t1")["device"] == 0
        assert run("t2")["device"] == 0
        assert run(None)["device"] == 0  # no header: the default tenant
        assert run("t1")["device"] == 6 * PAGE
        refused = httpx.post(f"{server.url}/generate", headers={"X-Tenant": "a/b"},
                             json={"input_ids": [1, 2]}, timeout=TIMEOUT)
        assert refused.status_code == 400 and "x-tenant" in refused.text


def test_an_authenticated_callers_pins_are_charged_to_its_own_tenant(
    server: RunningServer,
) -> None:
    """A key holder's hints spend its own tenant's pin budget: one naming no tenant is
    charged to the key's, one naming another tenant is a 400 that applies nothing."""
    ids = prompt(5)
    generate(server, ids, KEY_A)
    assert server.wait_idle()
    refused = post(server, "/hicache/hints", {"hints": [
        {"kind": "pin", "input_ids": ids, "tenant": "globex"}]}, KEY_A)
    assert refused.status_code == 400 and "hints[0]" in refused.text, refused.text
    assert "not the caller's tenant" in refused.text
    own = post(server, "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1},
        "hicache_hints": [{"kind": "pin", "tenant": "globex"}]}, KEY_A)
    assert own.status_code == 400 and "hicache_hints[0]" in own.text, own.text
    assert server.engine.hint_status()["pinned_pages_by_tenant"] == {}
    accepted = post(server, "/hicache/hints", {"hints": [
        {"kind": "pin", "input_ids": ids}]}, KEY_A)
    assert accepted.status_code == 200, accepted.text
    [pin] = accepted.json()["results"]
    assert pin["outcome"] == "accepted", pin
    assert server.engine.hint_status()["pinned_pages_by_tenant"] == {"acme": 6}
