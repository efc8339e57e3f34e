"""What each ``hicache`` command imports: serving never pulls in benchmark code.

``hicache serve`` and ``hicache router`` must import no ``hicache.bench`` module,
nothing of ``hicache.testing`` (the servers tests and benchmarks launch) and none
of the bench extra's packages (aiohttp, tqdm, matplotlib). ``hicache bench``
imports the chosen benchmark's module only; its --help imports none.

Each check runs the real ``hicache.cli.main`` in a fresh interpreter, so that
nothing this test process imported counts, and stops it just before it would
serve: uvicorn's ``Server.run`` returns at once, so nothing listens on the port
given (serve builds its engine, single process, before that; the router's
workers are found by a stand-in that answers without a network). The bench
extra's packages are made unimportable there, as where the extra is not
installed: torch itself tries ``tqdm`` at import and does without it, so "not
imported" is "not needed" (the command still runs through).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache.cli import BENCH_EXTRA_HINT, BENCH_EXTRA_MODULES

FORBIDDEN_PREFIXES = ("hicache.bench", "hicache.testing")
CHILD_TIMEOUT_S = 240.0  # a cold interpreter imports torch and builds a tiny engine

# Run in the child: the command's main() with the server's loop stubbed out, then the
# modules it left imported, as JSON on the last line of stdout.
_CHILD = """
import json, sys
for package in {blocked!r}:
    sys.modules[package] = None  # its import raises ModuleNotFoundError
import uvicorn
uvicorn.Server.run = lambda self, *args, **kwargs: None  # everything up to serving ran
{setup}
from hicache.cli import main
code = main({argv!r})
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""

_STAND_IN_WORKERS = """
import hicache.router.serve as router_serve
from hicache.router.workers import WorkerInfo
router_serve.discover_workers = lambda urls, *args, **kwargs: [
    WorkerInfo(url=url, page_size=16, model="stand-in") for url in urls
]
"""


def _imported_by(argv: list[str], tmp_path: Path, setup: str = "") -> list[str]:
    """The modules a run of ``hicache <argv>`` (stopped before serving) imported."""
    child = subprocess.run(
        [sys.executable, "-c",
         _CHILD.format(blocked=BENCH_EXTRA_MODULES, setup=setup, argv=argv)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
        env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, child.stderr[-4000:]
    modules: list[str] = result["modules"]
    return modules


def _forbidden(modules: list[str]) -> list[str]:
    return [name for name in modules if name.startswith(FORBIDDEN_PREFIXES)]


def test_serve_imports_no_benchmark_code(tmp_path: Path) -> None:
    modules = _imported_by(
        ["serve", "--device", "cpu", "--max-total-tokens", "1024", "--model-preset", "tiny",
         "--single-process", "--port", "9"],
        tmp_path,
    )
    # It did get as far as serving: the engine was built and the app created.
    assert {"hicache.engine.engine", "hicache.server.app", "hicache.storage.registry"} <= set(
        modules
    )
    assert _forbidden(modules) == []


def test_router_imports_no_benchmark_code(tmp_path: Path) -> None:
    modules = _imported_by(
        ["router", "--worker-urls", "http://127.0.0.1:9", "--port", "9"], tmp_path,
        setup=_STAND_IN_WORKERS,
    )
    assert {"hicache.router.app", "hicache.router.policy"} <= set(modules)
    assert _forbidden(modules) == []


def test_bench_help_lists_benchmarks_without_importing_them(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys\nfrom hicache.cli import main\n"
         "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
         "print(sorted(m for m in sys.modules if m.startswith('hicache.bench')))"],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr
    assert "radix tree insert / match / evict latency" in child.stdout  # the table's help
    assert child.stdout.strip().splitlines()[-1] == "[]"


def test_a_benchmark_imports_its_own_module_only(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys\nfrom hicache.cli import build_parser\n"
         "build_parser().parse_args(['bench', 'tree', '--repeats', '1'])\n"
         "print(sorted(m for m in sys.modules if m.startswith('hicache.bench')))"],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "['hicache.bench', 'hicache.bench.tree']"


def test_a_benchmark_without_the_bench_extra_names_it(tmp_path: Path) -> None:
    # tqdm made unimportable, as where the extra is not installed.
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys\nsys.modules['tqdm'] = None\nfrom hicache.cli import main\n"
         "main(['bench', 'multiturn', '--help'])"],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
    )
    assert child.returncode == 2, child.stderr
    assert "needs tqdm" in child.stderr and BENCH_EXTRA_HINT in child.stderr, child.stderr
