"""``hicache bench storage`` runs end to end at tiny sizes and reports against its baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hicache.bench import storage as bench
from hicache.cli import _BENCHMARKS


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


TINY = ("--preset", "tiny", "--page-size", "4", "--num-pages", "6", "--batch-pages", "4",
        "--repeats", "1")


def test_a_tiny_run_prints_the_backend_next_to_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    assert bench.main(parse(*TINY, "--dir", str(tmp_path / "work"), "--json", str(out))) == 0
    printed = capsys.readouterr().out
    assert "| backend | op | GB/s | pages/s | baseline GB/s | x baseline |" in printed
    results = json.loads(out.read_text())
    assert results["skipped"] == {}
    measured = {(r["backend"], r["op"]): r for r in results["results"]}
    # The checksum's cost where it moved: the cache's page copies, checked and not.
    copies = {
        (name, op)
        for name in ("copy + checksum", "copy + checksum baseline", "direct copy")
        for op in ("write", "load")
    }
    assert set(measured) == {
        ("file", "put"), ("file", "get"), ("file baseline", "put"), ("file baseline", "get"),
        *copies,
    }
    assert all(r["pages"] == 6 and r["gbps"] > 0 for r in measured.values())
    assert "| copy + checksum | load |" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| file |")]
    assert [row.split("|")[2].strip() for row in rows] == ["put", "get"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        ratio = float(cells[5])
        ours, base = measured[("file", cells[1])], measured[("file baseline", cells[1])]
        assert float(cells[3]) == pytest.approx(ours["pages_per_s"], abs=0.5)
        assert ratio == pytest.approx(ours["gbps"] / base["gbps"], abs=0.006)
    # Nothing is left behind in the directory it was given.
    assert list((tmp_path / "work").iterdir()) == []


def test_reads_can_go_unverified_to_show_what_verification_costs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, object]] = []
    real = bench.create_storage_backend

    def spy(name: str, extra: dict[str, object]) -> object:
        made.append(dict(extra))
        return real(name, extra)

    monkeypatch.setattr(bench, "create_storage_backend", spy)
    assert bench.main(parse(*TINY, "--dir", str(tmp_path), "--no-verify-checksum")) == 0
    assert "reads not verified" in capsys.readouterr().out
    assert made and made[0]["verify_checksum"] is False
    made.clear()
    assert bench.main(parse(*TINY, "--dir", str(tmp_path))) == 0
    assert "verify_checksum" not in made[0]  # the backend's default: verified


def test_a_backend_that_cannot_run_is_reported_as_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "unavailable_reason", lambda name: f"{name}: not installed here")
    monkeypatch.delitem(bench.BASELINES, "file")  # no baseline: no ratio
    args = parse(*TINY, "--backends", "file,mooncake", "--dir", str(tmp_path), "--fsync")
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "skipped mooncake: mooncake: not installed here" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| file |")]
    assert len(rows) == 2 and all(row.endswith("| - | - |") for row in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--batch-pages", "129"), "--batch-pages must be in [1, 128]"),
        (("--backends", "nfs"), "--backends: unknown nfs"),
        (("--preset", "gpt5"), "--preset: unknown 'gpt5'"),
        (("--num-pages", "0"), "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(parse(*argv)) == 2
    assert message in capsys.readouterr().out


def test_it_is_a_hicache_bench_subcommand() -> None:
    module, help_text = _BENCHMARKS["storage"]
    assert module == bench.__name__ and help_text


def test_the_mla_geometry_moves_mla_pages(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    args = parse(
        *TINY, "--geometry", "deepseek-v2-lite", "--dir", str(tmp_path), "--json", str(out)
    )
    assert bench.main(args) == 0
    results = json.loads(out.read_text())
    assert results["geometry"] == "MLA-L27-D576-bfloat16"
    # 4 tokens x 27 layers x one 576-element bf16 latent: no K/V pair.
    assert results["page_bytes"] == 4 * 27 * 576 * 2
    assert {r["backend"] for r in results["results"]} == {
        "file", "file baseline", "copy + checksum", "copy + checksum baseline", "direct copy",
    }


def test_encryption_keys_add_sealed_runs_against_the_plain_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"* 3 {'c4' * 32}\n")
    out = tmp_path / "results.json"
    assert bench.main(parse(*TINY, "--dir", str(tmp_path / "work"), "--json", str(out),
                            "--encryption-keys", str(keys))) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    measured = {(r["backend"], r["op"]): r for r in results["results"]}
    assert {("file sealed", "put"), ("file sealed", "get")} <= set(measured)
    for op in ("put", "get"):
        ratio = results["sealed_over_plain"][f"file {op}"]
        assert ratio == pytest.approx(
            measured[("file sealed", op)]["gbps"] / measured[("file", op)]["gbps"]
        )
        assert f"file {op} {ratio:.2f}x" in printed
    assert "sealed / plain throughput (target >= 0.8;" in printed
    assert results["seal_threads"] >= 1
    # The copies still have the plain run's checksums to verify.
    assert ("copy + checksum", "load") in measured


def test_sealed_runs_on_one_thread_read_back_what_they_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--seal-threads 1: the serial sealed path, measured and checked the same way."""
    out = tmp_path / "results.json"
    assert bench.main(parse(*TINY, "--dir", str(tmp_path / "work"), "--json", str(out),
                            "--encryption-keys", "random", "--seal-threads", "1")) == 0
    results = json.loads(out.read_text())
    assert results["seal_threads"] == 1
    assert {"file put", "file get"} <= set(results["sealed_over_plain"])
    assert "1 sealer threads" in capsys.readouterr().out
    assert bench.main(parse(*TINY, "--encryption-keys", "random", "--seal-threads", "0")) == 2
    assert "--seal-threads must be in [1, 4], got 0" in capsys.readouterr().out


def test_sealed_and_plain_runs_alternate_and_pool_their_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--alternations N: N sealed and N plain runs, each of --repeats rounds, pooled."""
    out = tmp_path / "results.json"
    assert bench.main(parse(*TINY, "--dir", str(tmp_path / "work"), "--json", str(out),
                            "--encryption-keys", "random", "--repeats", "2",
                            "--alternations", "3")) == 0
    measured = {(r["backend"], r["op"]): r for r in json.loads(out.read_text())["results"]}
    for name in ("file", "file sealed"):
        assert len(measured[(name, "put")]["samples_s"]) == 6, name
    assert len(measured[("file baseline", "put")]["samples_s"]) == 2  # not alternated
    assert "of 6, 3 runs each, alternating" in capsys.readouterr().out
    assert bench.main(parse(*TINY, "--encryption-keys", "random", "--alternations", "0")) == 2
    assert "--alternations must be >= 1" in capsys.readouterr().out


def test_a_key_file_without_a_default_key_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"acme 1 {'c4' * 32}\n")
    assert bench.main(parse(*TINY, "--encryption-keys", str(keys))) == 2
    assert "no key for the default tenant" in capsys.readouterr().out
    keys.write_text("acme 1 short\n")
    assert bench.main(parse(*TINY, "--encryption-keys", str(keys))) == 2
    assert f"{keys}:1: malformed key" in capsys.readouterr().out
