"""`hicache router`'s own policies: built from the flags, with the shared L3 and the tier
costs (measured from what workers report: tests/integration/router/test_measured_tier_costs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.router.index import PageIndex
from hicache.router.serve import RouterStartupError, build_default_policy
from hicache.router.settings import PolicyName, RouterSettings, SharedCacheType
from hicache.router.shared_pool import FileSharedPool
from hicache.router.workers import parse_server_info


def _info(**extra: Any) -> Any:
    return parse_server_info("http://127.0.0.1:1", {
        "page_size": 4, "served_model_name": "m", "model_path": "/m", **extra})


@pytest.mark.parametrize("name", ["round_robin", "least_load", "cache_aware", "tier_aware",
                                  "predicted_ttft"])
def test_the_flag_names_the_policy(name: str) -> None:
    settings = RouterSettings(policy=PolicyName(name))
    policy = build_default_policy(PageIndex(), settings, [_info()], {})
    assert policy.name == name


def test_a_shared_cache_the_workers_do_not_describe_refuses_to_start() -> None:
    settings = RouterSettings(shared_cache_type=SharedCacheType.HICACHE)
    with pytest.raises(RouterStartupError, match="hicache_l3_key_seed"):
        build_default_policy(PageIndex(), settings, [_info(hicache_storage_backend="file")], {})
    with pytest.raises(RouterStartupError, match="needs a worker"):
        build_default_policy(PageIndex(), settings, [], {})


def test_the_shared_cache_is_the_first_workers_l3(tmp_path: Any) -> None:
    info = _info(hicache_storage_backend="file", hicache_l3_key_seed="00" * 16,
                 hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}"}}')
    settings = RouterSettings(shared_cache_type=SharedCacheType.HICACHE)
    policy = build_default_policy(PageIndex(), settings, [info], {})
    assert isinstance(policy.shared, FileSharedPool)  # type: ignore[attr-defined]

