"""API key files, the tenant header and the precedence that makes a request's tenant."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cli import build_parser
from hicache.config import ConfigError
from hicache.server import serve
from hicache.tenancy.identity import (
    ANONYMOUS,
    Caller,
    IdentityError,
    TenantIdentity,
    check_header_name,
    identity_from_flags,
    key_digest,
    load_api_keys,
    parse_api_keys,
    resolve_tenant,
)
from hicache.tenancy.names import DEFAULT_TENANT_LABEL, check_tenant_name, tenant_label

KEY_FILE = f"""\
# tenants of the test deployment
{key_digest("alpha-secret")} acme

plain:beta-secret   globex   # a key written in clear, hashed at load
{key_digest("gamma").upper()} acme
"""


def test_a_key_file_maps_digests_and_plain_keys_to_tenants() -> None:
    keys = parse_api_keys(KEY_FILE, "keys.txt")
    assert keys.tenant_of("alpha-secret") == "acme"
    assert keys.tenant_of("beta-secret") == "globex"
    assert keys.tenant_of("gamma") == "acme"  # hex digits in either case
    assert keys.tenant_of("wrong") is None
    assert keys.tenant_of("plain:beta-secret") is None
    # Only digests are held: no key in clear.
    assert "beta-secret" not in repr(keys)


@pytest.mark.parametrize(("text", "message"), [
    ("abc acme\n", "keys.txt:1: a key is 64 hex digits"),
    (f"# c\n\n{key_digest('a')}\n", "keys.txt:3: expected '<sha256 hex of the key> <tenant>'"),
    (f"{key_digest('a')} acme extra\n", "keys.txt:1: expected"),
    ("plain: acme\n", "keys.txt:1: 'plain:' is followed by no key"),
    ("plain:k team/x\n", "keys.txt:1: a tenant name is 1-128 characters"),
    (f"plain:k acme\n{key_digest('k')} other\n", "keys.txt:2: the same key as line 1"),
    ("# nothing\n\n", "keys.txt: no API key in the file"),
    ("plain:k " + "t" * 129 + "\n", "keys.txt:1: a tenant name"),
])
def test_a_bad_key_file_names_its_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_api_keys(text, "keys.txt")
    assert str(caught.value).startswith(message), caught.value


def test_an_unreadable_key_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=r"nope\.txt: cannot read the API key file"):
        load_api_keys(missing)
    good = tmp_path / "keys.txt"
    good.write_text(KEY_FILE)
    assert load_api_keys(good).tenant_of("alpha-secret") == "acme"
    bad = tmp_path / "bad.txt"
    bad.write_text("plain:x ok\nnot-a-key acme\n")
    with pytest.raises(ConfigError, match=r"bad\.txt:2: "):
        identity_from_flags(str(bad), None)


def test_the_header_flag_is_an_http_header_name() -> None:
    assert check_header_name("X-Tenant") == "x-tenant"
    with pytest.raises(ConfigError, match="--tenant-header"):
        check_header_name("x tenant")


def test_precedence_body_then_key_then_header_then_default() -> None:
    assert resolve_tenant(None, None, None) is None  # the default tenant
    assert resolve_tenant("s", None, None) == "s"  # no identity: the body's key as given
    assert resolve_tenant(None, None, "gw") == "gw"
    assert resolve_tenant(None, "acme", "gw") == "acme"  # the key above the header
    assert resolve_tenant(None, "acme", None) == "acme"


def test_a_salt_nests_under_the_callers_tenant() -> None:
    # The body's salt is first, but inside the authenticated tenant: never another's.
    assert resolve_tenant("acme", "acme", None) == "acme"
    assert resolve_tenant("s1", "acme", None) == "acme/s1"
    assert resolve_tenant("globex", "acme", None) == "acme/globex"
    assert resolve_tenant("s1", None, "gw") == "gw/s1"
    assert resolve_tenant("s1", "acme", "gw") == "acme/s1"
    # A nested name is never a configured tenant (those have no "/").
    with pytest.raises(ValueError):
        check_tenant_name("acme/s1")


def test_a_caller_is_found_from_its_headers() -> None:
    identity = TenantIdentity(parse_api_keys(KEY_FILE, "k"), "x-tenant")
    caller = identity.caller({"authorization": "Bearer alpha-secret", "x-tenant": "gw"})
    assert caller == Caller("acme", "gw")
    assert caller.tenant(None) == "acme"
    assert identity.caller({"authorization": "bearer  beta-secret "}).key_tenant == "globex"
    for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Basic alpha-secret"},
                    {"authorization": "Bearer nope"}):
        with pytest.raises(IdentityError) as caught:
            identity.caller(headers)
        assert caught.value.status == 401
        assert "Authorization: Bearer <key>" in caught.value.message
    header_only = TenantIdentity(None, "x-tenant")
    assert header_only.caller({}) == ANONYMOUS
    assert header_only.caller({"x-tenant": "t1"}).tenant("s") == "t1/s"
    with pytest.raises(IdentityError) as caught:
        header_only.caller({"x-tenant": "a b"})
    assert caught.value.status == 400 and "x-tenant" in caught.value.message
    assert not TenantIdentity().enabled and header_only.enabled


def test_labels_name_the_default_tenant() -> None:
    assert tenant_label(None) == DEFAULT_TENANT_LABEL == "default"
    assert tenant_label("acme") == "acme"
    assert check_tenant_name("a.b:c@d-e_f") == "a.b:c@d-e_f"
    for bad in ("", "a b", "a/b", "t" * 129):
        with pytest.raises(ValueError, match="1-128 characters"):
            check_tenant_name(bad)


def test_hicache_serve_refuses_a_bad_key_file_before_loading_anything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine must not be built with a bad key file")

    monkeypatch.setattr(serve, "build_engine", no_engine)
    monkeypatch.setattr(serve, "EngineClient", no_engine)
    keys = tmp_path / "keys.txt"
    keys.write_text("plain:k acme\nplain:k globex\n")
    args = build_parser().parse_args(["serve", "--api-keys", str(keys), "--single-process"])
    assert serve.main(args) == 2
    assert f"{keys}:2: the same key as line 1" in caplog.text
    args = build_parser().parse_args(["serve", "--tenant-header", "bad header"])
    assert serve.main(args) == 2
    assert "--tenant-header" in caplog.text
