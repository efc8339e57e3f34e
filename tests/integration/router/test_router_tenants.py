"""The router resolves tenants as its workers do: a real router app with ``--api-keys``
and ``--tenant-header`` in front of two fake workers.

A request without a known key is a 401 that no worker hears of. Each request's pages
are hashed in its tenant's chain (the workers' KV events' scheme), so a prompt W1 holds
for tenant acme overlaps there for acme alone; tenant globex's identical prompt, or
globex naming acme as its salt, overlaps nowhere. The credentials and the gateway's
header reach the worker unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.events.messages import MEDIUM_GPU, BlockStored, KVEventBatch
from hicache.router.settings import (
    RouterSettings,
    SettingsError,
    add_arguments,
    settings_from_args,
)
from hicache.router.types import TierOverlap
from hicache.tenancy.identity import identity_from_flags, key_digest
from tests.router_fakes import FakeWorker, FirstPolicy, fake_workers
from tests.router_fixtures import RunningRouter, running_router

PAGE = 4
TOKENS = list(range(100, 116))
KEY_A, KEY_B = "key-of-acme", "key-of-globex"


def bearer(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def last_request(router: RunningRouter) -> tuple[list[int], str | None]:
    policy: FirstPolicy = router.policy
    request = policy.requests[-1]
    return list(request.page_hashes), request.tenant


def test_the_router_keeps_tenants_apart(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{key_digest(KEY_A)} acme\nplain:{KEY_B} globex\n")
    identity = identity_from_flags(str(keys), "X-Tenant")
    workers = [FakeWorker(page_size=PAGE), FakeWorker(page_size=PAGE)]
    with fake_workers(*workers) as urls, running_router(urls, identity=identity) as router:
        acme_pages = page_hashes(TOKENS, PAGE, tenant_root_digest("acme"))
        event = BlockStored(acme_pages, None, TOKENS, PAGE, None, MEDIUM_GPU)
        router.index.apply(urls[1], KVEventBatch(ts=0.0, events=[event]))
        body = {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 1}}

        for headers in ({}, bearer("wrong")):
            refused = router.post("/generate", json=body, headers=headers)
            assert refused.status_code == 401, refused.text
            assert "Authorization: Bearer <key>" in refused.json()["error"]["message"]
        assert router.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert not any(w.requests for w in workers)  # no worker heard of them

        sent = bearer(KEY_A, **{"X-Tenant": "gw"})
        assert router.post("/generate", json=body, headers=sent).status_code == 200
        hashes, tenant = last_request(router)
        assert tenant == "acme" and hashes == acme_pages
        assert router.index.overlaps(hashes, urls)[urls[1]] == TierOverlap(4, 4, 4)
        # The worker got the body and the credentials as the client sent them.
        forwarded = workers[0].headers[-1]
        assert forwarded["authorization"] == f"Bearer {KEY_A}"
        assert forwarded["x-tenant"] == "gw"
        assert workers[0].requests[-1][1] == body

        for extra in ({}, {"cache_salt": "acme"}, {"extra_key": "acme"}):
            answer = router.post("/generate", json={**body, **extra}, headers=bearer(KEY_B))
            assert answer.status_code == 200
            hashes, tenant = last_request(router)
            assert tenant is not None and tenant.startswith("globex")
            overlaps = router.index.overlaps(hashes, urls)
            assert all(o == TierOverlap(0, 0, 0) for o in overlaps.values()), extra
            assert not set(hashes) & set(acme_pages)

        # The OpenAI routes resolve the same way (the body's salt nested under the key's).
        chat = {"messages": [{"role": "user", "content": "hi"}], "input_ids": TOKENS,
                "cache_salt": "s"}
        assert router.post("/v1/chat/completions", json=chat,
                           headers=bearer(KEY_A)).status_code == 200
        hashes, tenant = last_request(router)
        assert tenant == "acme/s"
        assert hashes == page_hashes(TOKENS, PAGE, tenant_root_digest("acme/s"))

        # Hints: each prefix placed in its tenant's chain, the credentials passed on.
        hint = {"hints": [{"kind": "prefetch", "input_ids": TOKENS}]}
        answer = router.post("/hicache/hints", json=hint, headers=sent)
        assert answer.status_code == 200, answer.text
        assert last_request(router) == (acme_pages, "acme")
        hinted = next(w for w in workers if w.requests and w.requests[-1][0] == "/hicache/hints")
        assert hinted.headers[-1]["authorization"] == f"Bearer {KEY_A}"
        assert hinted.headers[-1]["x-tenant"] == "gw"
        assert router.post("/hicache/hints", json=hint).status_code == 401


def test_a_gateway_header_alone_names_the_tenant() -> None:
    identity = identity_from_flags(None, "X-Tenant")
    with fake_workers(FakeWorker(page_size=PAGE)) as urls, \
            running_router(urls, identity=identity) as router:
        body = {"input_ids": TOKENS}
        assert router.post("/generate", json=body, headers={"X-Tenant": "t1"}).status_code == 200
        assert last_request(router) == (page_hashes(TOKENS, PAGE, tenant_root_digest("t1")),
                                        "t1")
        assert router.post("/generate", json=body).status_code == 200
        assert last_request(router) == (page_hashes(TOKENS, PAGE), None)  # SGLang's hashes
        refused = router.post("/generate", json=body, headers={"X-Tenant": "a b"})
        assert refused.status_code == 400


def test_router_settings_show_the_identity_without_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"plain:{KEY_A} acme\n")
    settings = RouterSettings(identity=identity_from_flags(str(keys), None))
    assert settings.public()["identity"] == {"api_keys": True, "tenant_header": None}
    assert KEY_A not in repr(settings.public())
    assert key_digest(KEY_A) not in repr(settings.public())


@pytest.mark.parametrize("line", ["nothex acme", "plain:k bad/tenant"])
def test_a_bad_key_file_stops_the_router_naming_its_line(tmp_path: Path, line: str) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# keys\n{line}\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--api-keys", str(keys)])
    with pytest.raises(SettingsError, match=r"keys\.txt:2: "):
        settings_from_args(args)
