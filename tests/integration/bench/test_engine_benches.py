"""The engine benchmarks (step, attention, decode, sampling, cold-engine) on small cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hicache.bench import cold_engine
from hicache.bench.step import run_case
from hicache.cli import main
from tests.hf_checkpoints import variants, write_checkpoint


def test_step_bench_times_decode_steps_of_the_whole_batch() -> None:
    result = run_case(batch=6, context=40, steps=4, page_size=4, vocab=8)
    assert result["batch"] == 6 and result["steps"] == 4
    assert 0 < result["median_ms"] < 5_000
    assert result["p90_ms"] >= result["median_ms"] * 0.5


def test_attention_bench_checks_every_backend_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    code = main(["bench", "attention", "--cases", "3x40x1", "2x30x5", "--repeats", "2",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--page-size", "4",
                 "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    backends = {r["backend"] for r in results}
    assert {"gather", "cpu"} <= backends
    assert len(results) == 2 * len(backends)
    assert all(r["max_abs_error"] < 1e-4 and r["ms_per_layer"] > 0 for r in results)


def test_decode_bench_times_each_setting(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_checkpoint(variants()["llama-gqa"], model_dir)
    out = tmp_path / "decode.json"
    code = main(["bench", "decode", "--model-path", str(model_dir), "--batch", "1", "3",
                 "--context", "20", "--steps", "2", "--repeats", "1",
                 "--settings", "plain", "prepacked", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["setting"], r["batch"]) for r in results] == [
        ("plain", 1), ("prepacked", 1), ("plain", 3), ("prepacked", 3)]
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in results)


def test_sampling_bench_times_both_samplers(tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    code = main(["bench", "sampling", "--batch", "3", "--vocab", "600", "--repeats", "1",
                 "--logits", "zipf", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["temperature", "top_k", "top_p", "both"]
    assert results[0]["kept_tokens"] == 600 and results[1]["kept_tokens"] == 50
    assert all(r["row_by_row_ms"] > 0 and r["batched_ms"] > 0 for r in results)


def test_grammar_bench_times_the_mask_of_every_row(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_checkpoint(variants()["llama-gqa"], model_dir)
    out = tmp_path / "grammar.json"
    code = main(["bench", "grammar", "--model-path", str(model_dir), "--batch", "3",
                 "--tokens", "6", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())["results"]
    assert result["batch"] == 3 and result["masked_steps"] >= 1
    assert result["mask_ms"] > 0 and result["decode_step_ms"] > 0


def test_grammar_bench_counts_only_valid_answers() -> None:
    from hicache.bench.grammar import prompts, valid_call, valid_person

    assert len(set(prompts(100))) == 100
    assert valid_call("add", '{"a": 1, "b": -2}')
    assert not valid_call("add", '{"a": 1.5, "b": 2}') and not valid_call("add", '{"a": 1}')
    assert valid_call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert not valid_call("get_weather", '{"city": "Paris", "unit": "kelvin"}')
    assert not valid_call("other", "{}") and not valid_call("add", "{")
    assert valid_person({"name": "Ann", "age": 30, "city": "Rome", "likes": ["tea"]})
    assert not valid_person({"name": "Ann", "age": True, "city": "Rome", "likes": []})
    assert not valid_person({"name": "Ann", "age": 30, "city": "Rome"})


def test_cold_engine_percentiles_interpolate_as_numpy_does() -> None:
    values = sorted([3.0, 1.0, 7.5, 2.0, 9.0])
    for fraction in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert cold_engine._percentile(values, fraction) == pytest.approx(
            float(np.percentile(values, 100 * fraction)))
    assert cold_engine._percentile([4.0], 0.99) == 4.0


def test_cold_engine_bench_times_prompts_and_counts_each_threads_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    write_checkpoint(variants()["llama-gqa"], model_dir)
    extra = json.dumps({"path": str(tmp_path / "l3")})
    serve_args = (f"--model-path {model_dir} --device cpu --enable-hierarchical-cache "
                  "--hicache-storage-backend file "
                  f"--hicache-storage-backend-extra-config '{extra}'")
    code = main(["bench", "cold-engine", "--serve-args", serve_args, "--prompts", "3",
                 "--prompt-len", "40", "--output-len", "2", "--concurrency", "2",
                 "--settle-s", "0", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["duration_s"] > 0 and result["mean_ttft_ms"] > 0
    assert result["p99_ttft_ms"] >= result["mean_ttft_ms"]  # near the slowest of three
    assert result["mean_tpot_ms"] is not None and result["mean_tpot_ms"] > 0  # 2 tokens each
    names = {use["name"] for use in result["threads"]}
    assert "hicache-scheduler" in names  # the forward's thread, named
    assert any(name.startswith("hicache-l3-") for name in names)  # the file L3's threads
    assert sum(use["cpu_s"] for use in result["threads"]) > 0
