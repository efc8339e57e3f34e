"""The controller runs each backend call for its operation's tenant (the node's or the
request's cache salt) on the thread that runs it, and for nobody outside calls."""

from __future__ import annotations

import threading

from hicache.storage.call_tenant import call_tenant, current_tenant


def test_a_calls_tenant_is_seen_only_inside_it_and_only_on_its_thread() -> None:
    assert current_tenant() is None
    seen: list[str | None] = []
    with call_tenant("acme"):
        assert current_tenant() == "acme"
        other = threading.Thread(target=lambda: seen.append(current_tenant()))
        other.start()
        other.join()
        with call_tenant(None):
            assert current_tenant() is None
        assert current_tenant() == "acme"
    assert seen == [None]
    assert current_tenant() is None


def test_the_tenant_is_restored_when_the_call_raises() -> None:
    try:
        with call_tenant("acme"):
            raise RuntimeError("the backend failed")
    except RuntimeError:
        pass
    assert current_tenant() is None
