"""The identity of a model's weights: the namespace its L3 page keys are chained from.

Servers share L3 pages exactly when their model identities are equal (and their
KV geometry, dtype included, page size and TP layout: ``radix.keys``), so the
identity must change whenever the weights do, and only then.

- Weights from a model directory: a digest of its json files (config.json above
  all) and of the *bytes* of the safetensors files the loader reads. Neither the
  directory's name nor its place matter: two copies of one checkpoint share
  pages, two checkpoints of one shape in directories of the same name (or one
  written over the other) never do.
- Dummy weights: a seeded draw on the model's device (the same seed gives other
  weights on a GPU than on the CPU), named by the preset or the digest of the
  config.json whose shape they take.

Hashing a checkpoint reads all of it (xxh3 runs at several GB/s; the disk is the
limit), so each file's digest is remembered in ``weight-digests.json`` under the
local cache dir, keyed by the file's resolved path, size, mtime and ctime: a
restart does not rehash gigabytes, and any write to a file (even one that keeps
its size and puts its mtime back) changes its ctime and forces a rehash. The
digest file is a cache only: unreadable, corrupt or unwritable means a rehash,
never a failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from hicache.config import ConfigError
from hicache.local_cache import local_cache_dir
from hicache.model.loader import LoadFormat
from hicache.model.presets import DEFAULT_PRESET
from hicache.model.weights import checkpoint_files

logger = logging.getLogger(__name__)

DIGEST_FILE = "weight-digests.json"
_FORMAT = 1  # bump when the digest or the stamp changes meaning
_CHUNK_BYTES = 16 << 20
# A file modified this recently may be modified again within the same timestamp tick
# (coarse on some file systems) without its stamp changing: its digest is not remembered.
_RACY_WINDOW_NS = 2_000_000_000


@dataclass(frozen=True)
class FileStamp:
    """What changes when a file's bytes may have: its size, mtime and ctime."""

    size_bytes: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        stat = path.stat()
        return cls(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def file_digest(path: Path) -> str:
    """xxh3-128 of the file's bytes, as hex."""
    hasher = xxhash.xxh3_128()
    buffer = memoryview(bytearray(_CHUNK_BYTES))
    with path.open("rb", buffering=0) as f:
        while size := f.readinto(buffer):
            hasher.update(buffer[:size])
    return hasher.hexdigest()


class DigestCache:
    """File digests remembered across restarts in one JSON file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries = self._read()
        self._changed = False

    @classmethod
    def default(cls) -> DigestCache:
        return cls(local_cache_dir() / DIGEST_FILE)

    def digest(self, file: Path) -> str:
        """The digest of ``file``'s bytes: remembered if its stamp is unchanged, else hashed."""
        resolved = file.resolve()
        key = str(resolved)
        stamp = FileStamp.of(resolved)
        entry = self._entries.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == asdict(stamp):
            digest = entry.get("digest")
            if isinstance(digest, str):
                return digest
        logger.info("hashing %s (%.2f GB) for the L3 namespace", resolved,
                    stamp.size_bytes / 1e9)
        digest = file_digest(resolved)
        # Remember it only if the file did not change while it was read, nor may change
        # again unseen (see _RACY_WINDOW_NS).
        settled = time.time_ns() - stamp.mtime_ns > _RACY_WINDOW_NS
        if settled and FileStamp.of(resolved) == stamp:
            self._entries[key] = {"stamp": asdict(stamp), "digest": digest}
            self._changed = True
        return digest

    def save(self) -> None:
        """Write the digests learnt since loading; a failure is logged, never raised."""
        if not self._changed:
            return
        # Another server may have saved meanwhile: keep its entries, ours win, and drop
        # the files that are gone so the cache does not grow forever.
        merged = {**self._read(), **self._entries}
        entries = {key: value for key, value in merged.items() if os.path.exists(key)}
        temp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
            )
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _FORMAT, "files": entries}, f)
            # Atomic: a concurrent reader sees the old file or the new one, never half.
            os.replace(temp, self.path)
        except OSError as error:
            logger.warning("cannot save weight digests to %s (%s): the next start rehashes",
                           self.path, error)
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            return
        self._entries = entries
        self._changed = False

    def _read(self) -> dict[str, Any]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            logger.warning("ignoring unreadable weight digests %s (%s)", self.path, error)
            return {}
        if not (isinstance(raw, dict) and raw.get("format") == _FORMAT
                and isinstance(raw.get("files"), dict)):
            logger.warning("ignoring weight digests %s of an unknown format", self.path)
            return {}
        files: dict[str, Any] = raw["files"]
        return files


def model_identity(
    model_path: str | Path | None,
    load_format: LoadFormat | str,
    preset: str | None,
    device: torch.device,
    seed: int = 0,
    digests: DigestCache | None = None,
) -> str:
    """The L3 namespace of the weights ``load_model`` builds from the same arguments."""
    if LoadFormat(load_format) is LoadFormat.DUMMY:
        shape = preset or DEFAULT_PRESET
        if model_path is not None:  # the dir's config.json gives the shape, not its weights
            shape = file_digest(Path(model_path) / "config.json")
        return f"dummy-{shape}:seed{seed}:{device.type}"
    if model_path is None:
        raise ConfigError("--load-format auto needs --model-path (the weights to name)")
    return f"weights-{weights_digest(Path(model_path), digests)}"


def weights_digest(root: Path, digests: DigestCache | None = None) -> str:
    """The digest of a model directory's json files and safetensors bytes."""
    cache = digests if digests is not None else DigestCache.default()
    parts = [f"{path.name}:{file_digest(path)}" for path in sorted(root.glob("*.json"))]
    parts += [f"{path.name}:{cache.digest(path)}" for path in checkpoint_files(root)]
    cache.save()
    return xxhash.xxh3_128_hexdigest("\n".join(parts).encode())
