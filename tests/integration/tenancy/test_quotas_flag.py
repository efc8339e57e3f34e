"""--tenant-quotas FILE: read at start-up into the L3 config; a bad file stops ``hicache
serve`` with exit code 2 and a message naming the file and line, before any engine starts."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from hicache.cli import build_parser
from hicache.config import ConfigError
from hicache.server.args import (
    add_storage_args,
    cache_config_from_args,
    storage_config_from_args,
)
from hicache.server.serve import main as serve_main
from hicache.storage.config import StorageConfig
from hicache.tenancy.quotas import load_tenant_quotas


def parse(*argv: str) -> StorageConfig:
    parser = argparse.ArgumentParser()
    add_storage_args(parser)
    return storage_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_loads_the_file_into_the_l3_config(tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.txt"
    quotas.write_text("acme l3=4KB host=0.5\n* l3_ttl=60\n")
    config = parse("--hicache-storage-backend", "file", "--tenant-quotas", str(quotas))
    assert config.tenant_quotas is not None
    assert config.tenant_quotas.l3_bytes("acme") == 4000
    assert config.tenant_quotas.host_fraction("acme") == 0.5
    assert config.tenant_quotas.l3_ttl_s("anyone") == 60.0
    assert parse().tenant_quotas is None


def test_host_shares_reach_the_cache_config(tmp_path: Path) -> None:
    """host= is the tree's host quota (CacheConfig.tenant_host_fractions), with or without
    L3; a line without host= gives its tenant none."""
    quotas = tmp_path / "quotas.txt"
    quotas.write_text("acme host=0.5\ndefault l3=1MB host=0.25\nbeta l3=1MB\n* l3=1GB\n")
    args = build_parser().parse_args([
        "serve", "--model-preset", "tiny", "--enable-hierarchical-cache",
        "--tenant-quotas", str(quotas),
    ])
    assert cache_config_from_args(args).tenant_host_fractions == {"acme": 0.5, None: 0.25}
    plain = build_parser().parse_args(["serve", "--model-preset", "tiny"])
    assert cache_config_from_args(plain).tenant_host_fractions == {}


def test_load_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("acme l3=4KB\nacme l3=1\n")
    with pytest.raises(ConfigError, match=f"{bad}:2: tenant 'acme' is already given a line"):
        load_tenant_quotas(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_tenant_quotas(tmp_path / "missing.txt")


@pytest.mark.parametrize(("text", "words"), [
    ("acme l3=2GB\nbeta l3=lots\n", "bad.txt:2: l3= must be a size"),
    ("no/slash l3=1\n", "bad.txt:1: a tenant name is 1-128 characters"),
])
def test_serve_refuses_a_bad_quotas_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, words: str
) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text(text)
    args = build_parser().parse_args([
        "serve", "--model-preset", "tiny", "--hicache-storage-backend", "file",
        "--tenant-quotas", str(bad),
    ])
    with caplog.at_level(logging.ERROR):
        assert serve_main(args) == 2
    assert words in caplog.text
