"""/get_model_info, /get_server_info and the names SGLang's router probes (/model_info,
/server_info); the served model name and its last path component; no secrets shown."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.engine.config import CPU_CHUNKED_PREFILL_SIZE
from hicache.server.server_info import REDACTED, public_config
from tests.server_fixtures import RunningServer, serve_in_thread

SERVED = "/models/org/Tiny-Chat-1B"
KEY = "admin-secret"


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def server(l3_dir: Path) -> Iterator[RunningServer]:
    extra = json.dumps({"path": str(l3_dir), "prefetch_threshold": 32})
    args = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra]
    # Strict model names: which names a request may use is what the name tests check.
    with serve_in_thread(args, served_model_name=SERVED, admin_api_key=KEY,
                         l3_path_root=str(l3_dir), strict_model_name=True) as running:
        yield running


def get(server: RunningServer, route: str) -> dict[str, Any]:
    response = httpx.get(f"{server.url}{route}", timeout=30.0)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_model_info_under_both_names(server: RunningServer) -> None:
    info = get(server, "/get_model_info")
    assert info == get(server, "/model_info")
    # No --model-path: the byte-level tokenizer's dir, which SGLang's router and clients
    # load their tokenizer from (a name would send them to the Hugging Face hub).
    assert info["model_path"] == info["tokenizer_path"]
    assert Path(info["tokenizer_path"], "tokenizer.json").is_file()
    assert info["is_generation"] is True
    assert info["served_model_name"] == SERVED
    assert info["max_context_len"] == server.engine.max_context_len


def test_server_info_has_sglangs_arguments_and_the_live_l3(
    server: RunningServer, l3_dir: Path
) -> None:
    info = get(server, "/get_server_info")
    assert info.keys() == get(server, "/server_info").keys()
    assert info["page_size"] == 16
    assert info["tp_size"] == 1
    assert info["enable_hierarchical_cache"] is True
    assert info["hicache_write_policy"] == "write_through"
    assert info["hicache_mem_layout"] in ("layer_first", "page_first", "page_first_direct")
    assert info["served_model_name"] == SERVED
    assert info["max_total_num_tokens"] == 2048
    # The flag's default, resolved for the device (the server runs on the CPU).
    assert info["chunked_prefill_size"] == CPU_CHUNKED_PREFILL_SIZE
    assert info["hicache_storage_backend"] == "file"
    assert json.loads(info["hicache_storage_backend_extra_config"])["path"] == str(l3_dir)
    assert info["l3"]["attached"] is True and info["l3"]["prefetch_threshold"] == 32
    assert info["kv_events_endpoint"] is None and info["kv_events_config"] is None
    assert info["kv_events_replay_endpoint"] is None and info["kv_events_topic"] is None
    assert len(bytes.fromhex(info["hicache_l3_key_seed"])) == 16
    assert info["hicache_l3_object_order"] in ("lm", "tm")
    assert "cache_hit_rate" in info["internal_states"][0]
    assert info["version"]

    # Detached at run time, the server info says so; attached again, it shows the new config.
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.delete(f"{server.url}/hicache/storage-backend", headers=headers,
                        timeout=30.0).status_code == 200
    detached = get(server, "/get_server_info")
    assert detached["hicache_storage_backend"] is None and detached["l3"]["attached"] is False
    other = l3_dir / "other"
    attach = httpx.put(f"{server.url}/hicache/storage-backend", headers=headers, timeout=30.0,
                       json={"backend": "file", "extra_config": {"path": str(other)}})
    assert attach.status_code == 200, attach.text
    again = get(server, "/get_server_info")
    assert again["l3"]["config"] == {"path": str(other.resolve())}


@pytest.mark.parametrize("name", [SERVED, "Tiny-Chat-1B"])
def test_the_served_name_and_its_last_component_are_accepted(
    server: RunningServer, name: str
) -> None:
    completion = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                            json={"model": name, "prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == SERVED
    generated = httpx.post(f"{server.url}/generate", timeout=30.0,
                           json={"model": name, "text": "hi",
                                 "sampling_params": {"max_new_tokens": 2}})
    assert generated.status_code == 200, generated.text


def test_another_name_is_still_a_404(server: RunningServer) -> None:
    for route, body in [("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"})]:
        response = httpx.post(f"{server.url}{route}", timeout=30.0,
                              json={**body, "model": "org/Other-Model"})
        assert response.status_code == 404
        assert "does not exist" in response.json()["error"]["message"]
    card = get(server, "/v1/models")["data"][0]
    assert card["id"] == SERVED and card["root"] == "Tiny-Chat-1B"


def test_public_config_hides_secrets() -> None:
    config = {
        "master_server_address": "10.0.0.5:50051",
        "password": "hunter2",
        "nested": {"api_key": "k-123", "AccessKeyId": "AKIA", "port": 6379},
        "url": "redis://cache-user:s3cret@redis.internal:6379/0",
        "plain_url": "http://metadata:8080/metadata",
        "prefetch_threshold": 256,
    }
    shown = public_config(config)
    assert shown == {
        "master_server_address": "10.0.0.5:50051",
        "password": REDACTED,
        "nested": {"api_key": REDACTED, "AccessKeyId": REDACTED, "port": 6379},
        "url": f"redis://cache-user:{REDACTED}@redis.internal:6379/0",
        "plain_url": "http://metadata:8080/metadata",
        "prefetch_threshold": 256,
    }
    assert "hunter2" not in json.dumps(shown) and "s3cret" not in json.dumps(shown)


def test_the_prefill_rate_a_router_prices_tiers_with_is_reported(server: RunningServer) -> None:
    from hicache.router.tier_costs import worker_figures

    # 300 byte tokens: more than the 8 pages of prefill the router wants before trusting a rate.
    response = httpx.post(f"{server.url}/generate", timeout=60.0, json={
        "text": "".join(chr(97 + i % 26) for i in range(300)),
        "sampling_params": {"max_new_tokens": 1},
    })
    assert response.status_code == 200, response.text
    counters = get(server, "/get_server_info")["internal_states"][0]
    assert counters["engine_num_prefill_step_tokens"] >= 300
    assert counters["engine_prefill_step_seconds"] > 0
    metrics = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    assert "hicache_prefill_step_tokens_total" in metrics
    assert "hicache_prefill_step_seconds_total" in metrics
    # Either source gives the router the same rate.
    from_info = worker_figures(get(server, "/get_server_info"), None)
    from_metrics = worker_figures({"page_size": 16}, metrics)
    assert from_info.prefill_tokens_per_s is not None and from_info.prefill_tokens_per_s > 0
    assert from_metrics.prefill_tokens_per_s == pytest.approx(from_info.prefill_tokens_per_s)
