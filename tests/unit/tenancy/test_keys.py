"""The L3 encryption key file: what it accepts, and every error naming its line."""

from __future__ import annotations

import base64
import logging
import re
from pathlib import Path

import pytest

from hicache.config import ConfigError
from hicache.tenancy.keys import EVERY_TENANT, load_key_file, parse_key_file
from hicache.tenancy.names import check_tenant_name, tenant_label

HEX_A = "11" * 32
HEX_B = "22" * 32
B64_C = base64.b64encode(b"\x33" * 32).decode()


def test_lines_give_each_tenant_its_keys_and_the_last_one_writes() -> None:
    ring = parse_key_file(
        f"# tenant key-id key\n\nacme 1 {HEX_A}\n*  7  {B64_C}  # everyone else\n"
        f"acme 2 {HEX_B}\ndefault 3 {HEX_A.upper()}\n",
        "keys.txt",
    )
    assert [k.key_id for k in ring.keys_of("acme")] == [1, 2]
    write = ring.write_key("acme")
    assert write is not None and write.key_id == 2 and write.secret == b"\x22" * 32
    assert ring.read_key("acme", 1) is not None and ring.read_key("acme", 7) is None
    # A tenant without lines of its own takes the '*' lines; the default tenant is "default".
    other = ring.write_key("globex")
    assert other is not None and other.key_id == 7 and other.secret == b"\x33" * 32
    default = ring.write_key(None)
    assert default is not None and default.key_id == 3 and default.secret == b"\x11" * 32
    assert "\\x11" not in repr(ring) and "\\x22" not in repr(ring)  # keys stay out of logs


def test_without_a_star_line_a_tenant_has_no_key() -> None:
    ring = parse_key_file(f"acme 1 {HEX_A}\n", "k")
    assert ring.write_key("globex") is None and ring.keys_of(None) == ()
    assert EVERY_TENANT not in ring.keys


def test_url_safe_base64_is_accepted() -> None:
    secret = bytes([0xFB, 0xFF] * 16)
    ring = parse_key_file(f"* 0 {base64.urlsafe_b64encode(secret).decode()}\n", "k")
    key = ring.write_key("t")
    assert key is not None and key.secret == secret


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (f"acme 1 {HEX_A}\nacme 1\n", 2, "3 fields"),
        (f"acme 1 {HEX_A} extra\n", 1, "3 fields"),
        (f"acme x {HEX_A}\n", 1, "key id is an integer"),
        (f"acme -1 {HEX_A}\n", 1, "key id is an integer"),
        (f"acme 4294967296 {HEX_A}\n", 1, "key id is an integer"),
        ("acme 1 not-a-key!\n", 1, "malformed key"),
        (f"acme 1 {HEX_A[:-2]}\n", 1, "62 hex digits"),
        (f"acme 1 {base64.b64encode(bytes(16)).decode()}\n", 1, "this one is 16 bytes"),
        (f"bad/name 1 {HEX_A}\n", 1, "tenant name"),
        (f"acme 1 {HEX_A}\n\nacme 1 {HEX_B}\n", 3, "duplicate key id 1 for tenant 'acme'"),
    ],
)
def test_a_bad_line_names_the_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^keys.txt:{line}: .*") as error:
        parse_key_file(text, "keys.txt")
    assert message in str(error.value)


def test_the_same_key_id_may_serve_different_tenants() -> None:
    ring = parse_key_file(f"acme 1 {HEX_A}\nglobex 1 {HEX_B}\n", "k")
    acme, globex = ring.read_key("acme", 1), ring.read_key("globex", 1)
    assert acme is not None and globex is not None and acme.secret != globex.secret


def test_an_empty_or_missing_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(empty))}: no keys"):
        load_key_file(empty)
    with pytest.raises(ConfigError, match=r"cannot read .*missing\.keys"):
        load_key_file(tmp_path / "missing.keys")


def test_tenant_names() -> None:
    assert tenant_label(None) == "default" and tenant_label("a") == "a"
    assert check_tenant_name("user@example.com:team-1_x") == "user@example.com:team-1_x"
    for bad in ("", "a b", "x" * 129, "ü"):
        with pytest.raises(ValueError, match="1-128 characters"):
            check_tenant_name(bad)


def test_a_key_file_others_can_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"* 1 {HEX_A}\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert load_key_file(path).write_key(None) is not None
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_key_file(path).write_key(None) is not None
    assert "readable by other users (mode 644)" in caplog.text
