"""An engine over a file L3 with --l3-encryption-keys: what it stores is ciphertext, a page
it reads back answers as a cold run, per tenant; an engine with the same key file shares
the store, one with another key file misses (counted) and still answers correctly; a bad
key file stops start-up naming its line."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.cli import build_parser
from hicache.config import ConfigError
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.server.serve import main as serve_main
from hicache.storage.base import StorageError
from hicache.storage.frame import SEALED_FORMAT_VERSION, SEALED_HEADER_BYTES
from tests.engine_helpers import (  # noqa: F401 - make_engine_fixture: a fixture
    Run,
    collect,
    engine_config,
    make_engine_fixture,
)
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.l3_engine_checks import ENGINE_FLAGS, REUSED, l3_engine_flags

KEYS = f"acme 1 {'a1' * 32}\n* 1 {'5e' * 32}\n"
OTHER_KEYS = f"acme 1 {'0c' * 32}\n* 1 {'5e' * 32}\n"


def flags(store: Path, key_file: Path) -> tuple[str, ...]:
    return (
        *l3_engine_flags("file", {"path": str(store)}), "--hicache-reuse-policy", "load",
        "--l3-encryption-keys", str(key_file),
    )


def key_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def ask(engine: Engine, ids: list[int], tenant: str | None) -> Run:
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    return asyncio.run(collect(engine, GenerateRequest(tuple(ids), params, extra_key=tenant)))


def failures(engine: Engine) -> dict[str, int]:
    assert engine.cache.storage is not None
    return engine.cache.storage.backend.stats().failures


def page_files(store: Path) -> list[Path]:
    """Every page file: the default tenant's and, a directory level down, a tenant's."""
    found = [*store.glob("??/*.?m"), *store.glob("tenants/*/??/*.?m")]
    return sorted(p for p in found if p.is_file())


def test_sealed_pages_answer_as_cold_and_only_the_same_keys_read_them(
    make_engine: Callable[..., Engine], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    store = tmp_path / "l3"
    keys = key_file(tmp_path, "keys", KEYS)
    ids = prompt(21)
    # The plaintext an unsealed engine stores for the same prompt: never found sealed.
    clear_store = tmp_path / "clear"
    clear = make_engine(*l3_engine_flags("file", {"path": str(clear_store)}),
                        "--hicache-reuse-policy", "load")
    cold = {tenant: ask(clear, ids, tenant).token_ids for tenant in ("acme", None)}
    assert clear.flush_cache()
    clear.shutdown()
    plaintexts = [p.read_bytes() for p in page_files(clear_store)]
    assert plaintexts

    engine = make_engine(*flags(store, keys))
    for tenant in ("acme", None):
        assert ask(engine, ids, tenant).token_ids == cold[tenant]
    assert engine.flush_cache()  # L1 and L2 forget; L3 keeps the sealed pages
    for tenant in ("acme", None):
        warm = ask(engine, ids, tenant)
        assert warm.last.cached_tokens.storage == REUSED, tenant
        assert warm.token_ids == cold[tenant], tenant
    sealed = page_files(store)
    assert len(sealed) == len(plaintexts)
    for path in sealed:
        data = path.read_bytes()
        header = data[-SEALED_HEADER_BYTES:]
        assert header[:4] == b"HCKV" and header[4] == SEALED_FORMAT_VERSION
        for plain in plaintexts:
            payload = plain[: len(data) - SEALED_HEADER_BYTES]
            assert payload[:256] not in data and payload[-256:] not in data
    assert not failures(engine)

    # A second instance with the same key file hits what the first stored.
    twin = make_engine(*flags(store, keys))
    for tenant in ("acme", None):
        shared = ask(twin, ids, tenant)
        assert shared.last.cached_tokens.storage == REUSED, tenant
        assert shared.token_ids == cold[tenant]
    twin.shutdown()

    # Another key file (acme's key differs): acme misses, counted, and answers as cold.
    stranger = make_engine(*flags(store, key_file(tmp_path, "other", OTHER_KEYS)))
    with caplog.at_level(logging.WARNING, logger="hicache.storage.failure_log"):
        missed = ask(stranger, ids, "acme")
    assert missed.last.cached_tokens.storage == 0
    assert missed.token_ids == cold["acme"]
    assert failures(stranger).get("bad_tag", 0) >= 1
    assert "failed authentication" in caplog.text  # logged with what it means


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"acme 1 {'a1' * 32}\nacme 1 {'a2' * 32}\n", "keys.txt:2: duplicate key id 1"),
        (f"acme 1 {'a1' * 31}\n", "keys.txt:1: a key is 256 bits"),
        (f"# comment\nacme one {'a1' * 32}\n", "keys.txt:2: a key id is an integer"),
        ("acme 1\n", "keys.txt:1: expected '<tenant|*> <key id> <key>'"),
    ],
)
def test_a_bad_key_file_stops_start_up_naming_the_line(
    tmp_path: Path, text: str, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad = key_file(tmp_path, "keys.txt", text)
    store = tmp_path / "l3"
    with pytest.raises(ConfigError, match=re.escape(words)):
        engine_config(*flags(store, bad))
    args = build_parser().parse_args(
        ["serve", "--device", "cpu", "--model-preset", "tiny", "--max-total-tokens", "1024",
         "--hicache-storage-backend", "file", "--l3-encryption-keys", str(bad)]
    )
    with caplog.at_level(logging.ERROR):
        assert serve_main(args) == 2
    assert words in caplog.text and str(bad) in caplog.text
    assert not store.exists()


def test_a_backend_that_cannot_seal_is_refused_at_start_up(tmp_path: Path) -> None:
    keys = key_file(tmp_path, "keys", KEYS)
    with pytest.raises(ConfigError, match="the lmcache backend cannot encrypt pages"):
        engine_config("--enable-hierarchical-cache", "--hicache-storage-backend", "lmcache",
                      "--l3-encryption-keys", str(keys))


def test_a_store_attached_later_through_the_admin_api_is_sealed_too(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    """The server's keys apply to every store it attaches, not only the one at start-up:
    an attach through the admin API never writes plaintext, and refuses a backend that
    cannot seal."""
    keys = key_file(tmp_path, "keys", KEYS)
    engine = make_engine(*ENGINE_FLAGS, "--hicache-storage-backend", "none",
                         "--hicache-reuse-policy", "load", "--l3-encryption-keys", str(keys))
    assert engine.cache.storage is None
    with pytest.raises(StorageError, match="'lmcache' cannot encrypt pages"):
        engine.attach_storage("lmcache", {"remote_url": "lm://127.0.0.1:1"}, "wait_complete")
    store = tmp_path / "attached"
    extra = {"path": str(store), "prefetch_threshold": 64}
    engine.attach_storage("file", extra, "wait_complete")
    engine.attach_storage("file", extra, "timeout")  # the same store: only the policy changes
    ids = prompt(22)
    cold = ask(engine, ids, "acme")
    assert engine.flush_cache()
    warm = ask(engine, ids, "acme")
    assert warm.last.cached_tokens.storage == REUSED and warm.token_ids == cold.token_ids
    files = page_files(store)
    assert files and all(p.read_bytes()[-SEALED_HEADER_BYTES:][4] == 2 for p in files)


def test_rotation_reads_old_pages_and_deleting_a_key_shreds_them(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    """Appending a key rotates (new pages sealed under it, old ones still read); deleting
    the old key makes everything sealed under it a miss (counted unknown_key): the pages
    are gone for every server using the file, wherever the store keeps them."""
    store = tmp_path / "l3"
    old, new = f"acme 1 {'a1' * 32}\n", f"acme 2 {'a2' * 32}\n"
    before, after = prompt(23), prompt(24)
    first = make_engine(*flags(store, key_file(tmp_path, "v1", old)))
    cold_before = ask(first, before, "acme").token_ids
    assert first.flush_cache()
    first.shutdown()

    rotated = make_engine(*flags(store, key_file(tmp_path, "v2", old + new)))
    hit = ask(rotated, before, "acme")  # written under key 1, read with it
    assert hit.last.cached_tokens.storage == REUSED and hit.token_ids == cold_before
    cold_after = ask(rotated, after, "acme").token_ids  # sealed under key 2
    assert rotated.flush_cache()
    rotated.shutdown()

    shredded = make_engine(*flags(store, key_file(tmp_path, "v3", new)))
    gone = ask(shredded, before, "acme")
    assert gone.last.cached_tokens.storage == 0 and gone.token_ids == cold_before
    assert failures(shredded).get("unknown_key", 0) >= 1
    kept = ask(shredded, after, "acme")
    assert kept.last.cached_tokens.storage == REUSED and kept.token_ids == cold_after
