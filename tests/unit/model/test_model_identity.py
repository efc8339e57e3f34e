"""The L3 namespace of a model follows the bytes of its weights, and hashing them is remembered.

Model dirs here are a config.json and a "model.safetensors" of plain bytes: the
identity never parses the weights, it hashes what the loader would read. Files
get an mtime in the past (``settle``): a file modified in the last moments is
hashed every time, never remembered (its next write could keep the same stamp).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hicache.model.identity as identity
from hicache.model.identity import DigestCache, model_identity

WEIGHTS_BYTES = 3 * 2**20 + 17  # three whole reads of 1 MiB and a tail (see small_chunks)
HOUR_NS = 3600 * 10**9


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reads of 1 MiB: a file of a few MiB is hashed over several reads and a tail.
    monkeypatch.setattr(identity, "_CHUNK_BYTES", 2**20)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the weight files hashed since the test began."""
    names: list[str] = []
    real = identity.file_digest

    def counting(path: Path) -> str:
        if path.suffix == ".safetensors":
            names.append(path.name)
        return real(path)

    monkeypatch.setattr(identity, "file_digest", counting)
    yield names


def settle(path: Path, age_ns: int = HOUR_NS) -> None:
    """Give ``path`` an mtime ``age_ns`` in the past."""
    stamp = time.time_ns() - age_ns
    os.utime(path, ns=(stamp, stamp))


def make_model_dir(root: Path, payload: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (root / "model.safetensors").write_bytes(payload)
    settle(root / "model.safetensors")
    return root


def weights_id(model_dir: Path, cache_file: Path) -> str:
    """The identity as a fresh server start computes it (the digest cache read from disk)."""
    return model_identity(model_dir, "auto", None, torch.device("cpu"),
                          digests=DigestCache(cache_file))


def payload(seed: int) -> bytes:
    return torch.randint(0, 256, (WEIGHTS_BYTES,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_other_bytes_of_the_same_size_are_another_identity(
    tmp_path: Path, hashed: list[str]
) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    first = weights_id(model, cache)
    weights = model / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, mid-file: same size
    weights.write_bytes(bytes(data))
    # Even with its old mtime back (as `cp -p` or `rsync -t` would leave it), the write
    # changed the file's ctime: the remembered digest is not used.
    os.utime(weights, ns=(mtime_ns, mtime_ns))
    second = weights_id(model, cache)
    assert second != first
    assert hashed == ["model.safetensors", "model.safetensors"]


def test_same_config_other_weights_in_a_dir_of_the_same_name(tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    a = make_model_dir(tmp_path / "a" / "model", payload(1))
    b = make_model_dir(tmp_path / "b" / "model", payload(2))
    copy = make_model_dir(tmp_path / "elsewhere" / "renamed", payload(1))
    assert weights_id(a, cache) != weights_id(b, cache)
    # The name and place of a directory do not matter: copies of one checkpoint share.
    assert weights_id(a, cache) == weights_id(copy, cache)


def test_a_config_change_is_another_identity(tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    before = weights_id(model, cache)
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert weights_id(model, cache) != before


def test_unchanged_weights_are_not_hashed_again_after_a_restart(
    tmp_path: Path, hashed: list[str]
) -> None:
    cache = tmp_path / "cache" / "digests.json"  # its directory is made on first save
    model = make_model_dir(tmp_path / "model", payload(1))
    first = weights_id(model, cache)
    assert hashed == ["model.safetensors"]
    assert cache.is_file()
    assert weights_id(model, cache) == first
    assert weights_id(model, cache) == first
    assert hashed == ["model.safetensors"]  # twice from the digest file, no rehash


def test_a_changed_mtime_rehashes(tmp_path: Path, hashed: list[str]) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    first = weights_id(model, cache)
    settle(model / "model.safetensors", age_ns=2 * HOUR_NS)
    assert weights_id(model, cache) == first  # same bytes: same identity
    assert hashed == ["model.safetensors", "model.safetensors"]
    assert weights_id(model, cache) == first
    assert len(hashed) == 2  # the new stamp was remembered


def test_a_file_written_moments_ago_is_never_remembered(
    tmp_path: Path, hashed: list[str]
) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    settle(model / "model.safetensors", age_ns=0)
    first = weights_id(model, cache)
    assert weights_id(model, cache) == first
    assert len(hashed) == 2


@pytest.mark.parametrize("content", [
    b"", b"{not json", b'{"format": 1, "files": []}', b'{"format": 999, "files": {}}',
    b'{"format": 1, "files": {"x": 3}}', b"\xff\xfe\x00garbage",
])
def test_a_corrupt_digest_file_means_a_rehash_never_a_failure(
    tmp_path: Path, hashed: list[str], content: bytes
) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    expected = weights_id(model, tmp_path / "other.json")
    cache.write_bytes(content)
    assert weights_id(model, cache) == expected
    assert len(hashed) == 2
    # ... and the file was rewritten whole: the next start reads it.
    assert weights_id(model, cache) == expected
    assert len(hashed) == 2


def test_a_remembered_digest_is_trusted_only_at_its_stamp(
    tmp_path: Path, hashed: list[str]
) -> None:
    cache = tmp_path / "digests.json"
    model = make_model_dir(tmp_path / "model", payload(1))
    first = weights_id(model, cache)
    saved = json.loads(cache.read_text())
    (entry,) = saved["files"].values()
    entry["digest"] = "0" * 32  # forged: the stamp still matches the file
    cache.write_text(json.dumps(saved))
    assert weights_id(model, cache) != first  # proof that the remembered digest is what counts
    settle(model / "model.safetensors", age_ns=3 * HOUR_NS)
    assert weights_id(model, cache) == first  # another stamp: hashed again
    assert len(hashed) == 2


def test_an_unwritable_cache_dir_is_no_failure(tmp_path: Path, hashed: list[str]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    model = make_model_dir(tmp_path / "model", payload(1))
    first = weights_id(model, blocker / "digests.json")
    assert weights_id(model, blocker / "digests.json") == first
    assert len(hashed) == 2


def test_the_digest_file_forgets_weights_that_are_gone(tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    gone = make_model_dir(tmp_path / "gone", payload(1))
    kept = make_model_dir(tmp_path / "kept", payload(2))
    weights_id(gone, cache)
    (gone / "model.safetensors").unlink()
    weights_id(kept, cache)
    remembered = json.loads(cache.read_text())["files"]
    assert list(remembered) == [str((kept / "model.safetensors").resolve())]


def test_every_shard_is_hashed(tmp_path: Path, hashed: list[str]) -> None:
    cache = tmp_path / "digests.json"
    model = tmp_path / "sharded"
    model.mkdir()
    (model / "config.json").write_text("{}")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, name in enumerate(names):
        (model / name).write_bytes(payload(i))
        settle(model / name)
    index = {"weight_map": {"a": names[0], "b": names[1]}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    before = weights_id(model, cache)
    assert sorted(hashed) == names
    data = bytearray((model / names[1]).read_bytes())
    data[-1] ^= 1
    (model / names[1]).write_bytes(bytes(data))
    assert weights_id(model, cache) != before


def test_dummy_weights_are_named_by_shape_seed_and_device(tmp_path: Path) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # The same seed draws other weights on a GPU than on the CPU: other page keys.
    assert model_identity(None, "dummy", "tiny", cpu) == "dummy-tiny:seed0:cpu"
    assert model_identity(None, "dummy", "tiny", cuda) == "dummy-tiny:seed0:cuda"
    assert model_identity(None, "dummy", None, cpu) == "dummy-tiny:seed0:cpu"
    assert model_identity(None, "dummy", "tiny", cpu, seed=1) != "dummy-tiny:seed0:cpu"
    # A dir's shape with dummy weights shares nothing with the dir's real weights.
    model = make_model_dir(tmp_path / "model", payload(1))
    dummy = model_identity(model, "dummy", None, cpu)
    assert dummy.startswith("dummy-") and dummy.endswith(":seed0:cpu")
    assert dummy != weights_id(model, tmp_path / "digests.json")
