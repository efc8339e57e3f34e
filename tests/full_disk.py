"""A real, small, full file system for tests: a tmpfs mounted in a private mount namespace.

``run_on_tmpfs`` runs a command in a child process that has its own user and
mount namespaces (``unshare --user --map-root-user --mount``), so it may mount
a size-limited tmpfs on an empty directory without privileges on the machine;
the mount is seen by that child alone and disappears with it. Writes past the
size fail with a real ENOSPC from the kernel.

``file_backend_fill`` is the child used by the file backend's tests: it writes
batches of pages into a file backend whose size cap is far above what the
tmpfs holds (optionally with a free-space reserve, and with another program's
file taking part of the disk half-way), reads each batch back, and prints what
happened as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Mount a tmpfs of size $0 on $1, then run the rest of the arguments.
_MOUNT_AND_RUN = 'dir="$1"; shift; mount -t tmpfs -o size="$0" tmpfs "$dir" && exec "$@"'
TIMEOUT_S = 120.0
_REPO_ROOT = Path(__file__).resolve().parents[1]


def run_on_tmpfs(
    size_bytes: int, mount_dir: Path, argv: list[str], timeout_s: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with a ``size_bytes`` tmpfs mounted on ``mount_dir`` (for it alone)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise FileNotFoundError("unshare (util-linux) is not installed")
    command = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT_AND_RUN,
               str(size_bytes), str(mount_dir), *argv]
    # The child imports the same hicache and tests as this process.
    paths = [str(_REPO_ROOT), *(p for p in sys.path if p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=_REPO_ROOT, check=False)


@functools.cache
def tmpfs_unavailable_reason() -> str | None:
    """Why ``run_on_tmpfs`` cannot work here (no unshare, namespaces refused), or None."""
    with tempfile.TemporaryDirectory() as probe:
        try:
            done = run_on_tmpfs(1 << 20, Path(probe), ["true"], timeout_s=30.0)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"cannot run unshare: {error}"
    if done.returncode != 0:
        return f"cannot mount a private tmpfs: {done.stderr.strip()}"
    return None


def file_backend_fill(
    root: str, num_batches: int, batch_pages: int, min_free: int | None = None,
    ballast_bytes: int = 0,
) -> dict[str, object]:
    """Write ``num_batches`` batches into a file backend at ``root`` (leaving ``min_free``
    bytes free; None: its default) and read each back; after half of them another
    file of ``ballast_bytes`` takes part of the file system."""
    import torch

    from hicache.config import MemLayout
    from hicache.memory.geometry import KVGeometry
    from hicache.memory.host_pool import HostPool
    from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
    from hicache.storage.backends.file.backend import FileBackend
    from tests.storage_contract import as_bytes, fill_random, page_bytes_of, page_range

    # 16 KiB pages: a few dozen fill the tmpfs.
    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    page_size = 4
    host = HostPool(geometry, 2 * batch_pages, page_size, MemLayout.PAGE_FIRST,
                    pin_memory=False)
    config: dict[str, object] = {"path": root, "max_bytes": 10**12}  # the disk fills first
    if min_free is not None:
        config["min_free_bytes"] = min_free
    backend = FileBackend(config)
    backend.attach(host)
    seed = KeyNamespace("full-disk", geometry.describe(), page_size).seed()
    source, target = page_range(0, batch_pages), page_range(batch_pages, 2 * batch_pages)
    batches: list[dict[str, object]] = []
    all_keys: list[bytes] = []
    files_before_ballast = 0
    for batch in range(num_batches):
        if ballast_bytes and batch == num_batches // 2:
            files_before_ballast = _page_files(root)
            with open(os.path.join(os.path.dirname(root), "ballast"), "wb") as ballast:
                ballast.write(b"\0" * ballast_bytes)
        tokens = list(range(batch * 1000, batch * 1000 + batch_pages * page_size))
        keys = chain_page_keys(pack_tokens(tokens), page_size, seed)
        all_keys.extend(keys)
        values = fill_random(host, source, seed=batch)
        stored = backend.set(keys, source)
        read = backend.get(keys, target)
        disk = os.statvfs(root)
        batches.append({
            "stored": stored, "read": read,
            "equal": page_bytes_of(host, target) == as_bytes(values),
            "free": disk.f_bavail * disk.f_frsize, "files": _page_files(root),
        })
    backend.check_integrity()
    still_stored = [backend.exists([key]) for key in all_keys]
    backend.close()
    return {
        "batches": batches,
        "failures": backend.stats().failures,
        "still_stored": still_stored,
        "files": _page_files(root),
        "files_before_ballast": files_before_ballast,
        "min_free": backend.min_free_bytes,
    }


def _page_files(root: str) -> int:
    """Page files under ``root`` (the directory's ledger, one file at its top, is none)."""
    return sum(len(files) for directory, _, files in os.walk(root) if directory != root)


if __name__ == "__main__":
    root_arg, batches_arg, pages_arg = sys.argv[1:4]
    min_free_arg = int(sys.argv[4]) if len(sys.argv) > 4 else None
    ballast_arg = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    print(json.dumps(file_backend_fill(root_arg, int(batches_arg), int(pages_arg),
                                       min_free_arg, ballast_arg)))
