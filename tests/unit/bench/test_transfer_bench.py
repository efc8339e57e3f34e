"""``hicache bench transfer`` runs on CPU at tiny sizes, for MHA and MLA geometries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hicache.bench import transfer as bench
from hicache.memory.geometry import GEOMETRY_PRESETS


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v2-lite"])
def test_a_tiny_cpu_run_reports_every_layout_and_op(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    args = parse(
        "--device", "cpu", "--geometry", name, "--page-sizes", "4", "--pages", "3",
        "--repeats", "1", "--backends", "direct", "--json", str(out),
    )
    assert bench.main(args) == 0
    geometry = GEOMETRY_PRESETS[name]
    results = json.loads(out.read_text())
    assert results["geometry"] == geometry.describe()
    measured = {(r["layout"], r["op"]) for r in results["results"] if r["backend"] == "direct"}
    assert len(measured) == 3 * 3  # every host layout x load, load_layerwise, store
    assert {r["bytes"] for r in results["results"]} == {3 * geometry.page_bytes(4)}
    assert f"hicache bench transfer: {geometry.describe()} KV on cpu" in capsys.readouterr().out
