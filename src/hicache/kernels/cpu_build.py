"""Build a C++ source into a shared library once per machine, and load it.

The CPU kernels (``attention/cpu_paged_attention.cpp``, ``kernels/cpu_layer_ops.cpp``)
need no torch headers: each is compiled at first use with g++ (``-march=native``) into
``$HICACHE_CACHE_DIR/kernels/``, under a name that hashes the source, the flags,
the compiler and this CPU, so a changed source or another machine rebuilds, and
called through ctypes. A library is built beside its final name and renamed, so
concurrent builders never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hicache.local_cache import local_cache_dir

COMPILE_TIMEOUT_S = 120.0
DISABLE_ENV = "HICACHE_DISABLE_CPU_KERNEL"


class CpuBuildError(RuntimeError):
    """No compiler, a failed build, or the kernels switched off."""


class LazyLibrary:
    """A library built and loaded by ``load`` at its first use, once; where that fails
    (``errors``), ``library`` stays None and ``reason`` says why, and ``on_failure`` is
    called once with the error (to log what runs instead)."""

    def __init__(
        self, load: Callable[[], ctypes.CDLL], errors: tuple[type[Exception], ...],
        on_failure: Callable[[Exception], None],
    ) -> None:
        self._load = load
        self._errors = errors
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._tried = False
        self.library: ctypes.CDLL | None = None
        self.reason: str | None = None

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self.library = self._load()
                except self._errors as error:
                    self.reason = str(error)
                    self._on_failure(error)
            return self.library


def build_and_load(source: Path, flags: Sequence[str]) -> ctypes.CDLL:
    """``source`` compiled with ``flags`` (cached per machine), loaded."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        raise CpuBuildError(f"{DISABLE_ENV} is set")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise CpuBuildError("no C++ compiler (g++) found")
    path = _library_path(source, flags, compiler)
    if not path.exists():
        _compile(source, flags, compiler, path)
    return ctypes.CDLL(str(path))


def _library_path(source: Path, flags: Sequence[str], compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), version.encode(),
                 _cpu_signature().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return local_cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def _compile(source: Path, flags: Sequence[str], compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False,
        )
        if done.returncode != 0:
            raise CpuBuildError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
