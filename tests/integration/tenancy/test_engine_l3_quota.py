"""Tenant L3 quotas in a serving engine (tiny model, file L3, ``--tenant-quotas``): a tenant
over its quota keeps only its newest prompt in L3, another tenant keeps all of its own, and
answers from L3 equal the cold ones, per tenant."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import torch

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.storage.frame import HEADER_BYTES
from tests.engine_helpers import Run, collect

PAGE = 16
PROMPT_LEN = 200


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PROMPT_LEN,), generator=generator).tolist()


def ask(engine: Engine, ids: list[int], tenant: str | None) -> Run:
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    return asyncio.run(collect(engine, GenerateRequest(tuple(ids), params, extra_key=tenant)))


def settle(engine: Engine) -> None:
    """Every backup queued so far has reached L3."""
    storage = engine.cache.storage
    assert storage is not None, engine.cache.storage_error
    engine.scheduler.call(lambda: engine.cache.poll(wait=True)).result(timeout=60.0)
    assert storage.controller.wait_idle(60.0)


def test_a_tenant_over_its_quota_keeps_its_newest_pages_and_others_keep_theirs(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    probe = make_engine("--page-size", str(PAGE), "--max-total-tokens", "2048",
                        "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first")
    assert probe.cache.host_pool is not None
    page_file = probe.cache.host_pool.page_bytes + HEADER_BYTES
    probe.shutdown()
    prompt_pages = PROMPT_LEN // PAGE  # 12 whole pages of each prompt reach L3 (or 13)
    quotas = tmp_path / "quotas.txt"
    quotas.write_text(f"acme l3={(prompt_pages + 2) * page_file}\n")
    engine = make_engine(
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first", "--hicache-io-backend", "direct",
        "--hicache-reuse-policy", "load", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config",
        json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": 16}),
        "--tenant-quotas", str(quotas),
    )
    other, old, new = prompt(1), prompt(2), prompt(3)
    cold = {name: ask(engine, ids, tenant) for name, ids, tenant in
            (("other", other, "other"), ("old", old, "acme"), ("new", new, "acme"))}
    assert all(run.last.cached_tokens.total == 0 for run in cold.values())
    settle(engine)
    storage = engine.cache.storage
    assert storage is not None
    usage = storage.controller.tenant_usage()
    assert usage is not None
    assert usage["acme"] <= (prompt_pages + 2) * page_file
    assert usage["other"] >= prompt_pages * page_file

    assert engine.flush_cache()  # L1 and L2 forget: hits now come from L3 alone
    reused = (PROMPT_LEN - 1) // PAGE * PAGE
    again_other = ask(engine, other, "other")
    assert again_other.last.cached_tokens.storage == reused
    assert again_other.token_ids == cold["other"].token_ids
    again_new = ask(engine, new, "acme")
    assert again_new.last.cached_tokens.storage == reused
    assert again_new.token_ids == cold["new"].token_ids
    again_old = ask(engine, old, "acme")  # its oldest pages were evicted for the quota
    assert again_old.last.cached_tokens.storage == 0
    assert again_old.token_ids == cold["old"].token_ids
    # The same prompt as another tenant's: nothing of theirs is found.
    assert ask(engine, other, "acme").last.cached_tokens.total == 0
    engine.check_integrity()
