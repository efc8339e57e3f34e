"""The bench client keeps what the server said of its own part of a request: its TTFT and
its load-or-recompute report, through to the run's log."""

from __future__ import annotations

from hicache.bench.client import GenerateStream
from hicache.bench.report import RequestRecord

REUSE = {"decision": "load", "cached_tokens": 256, "loaded_tokens": 128,
         "recomputed_tokens": 0, "predicted_s": 0.05, "waited_s": 0.02, "actual_s": 0.07}


def _finish(stream: GenerateStream, meta: dict[str, object]) -> None:
    stream.feed({"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}, 0.5)
    stream.feed({"text": "ab", "output_ids": [5, 6], "meta_info": {
        "completion_tokens": 2, "finish_reason": {"type": "length"}, **meta}}, 0.9)


def test_server_ttft_and_reuse_report_are_read_from_the_last_meta_info() -> None:
    stream = GenerateStream(0.0)
    _finish(stream, {"ttft": 0.31, "reuse": REUSE})
    result = stream.result(1.0, done=True)
    assert result.server_ttft_s == 0.31 and result.reuse == REUSE
    assert result.ttft_s == 0.5  # the client's own, from its clock


def test_absent_or_malformed_server_fields_leave_none() -> None:
    for meta in ({}, {"ttft": None, "reuse": None}, {"ttft": "soon", "reuse": [1]},
                 {"ttft": True}, {"ttft": -1.0}):
        stream = GenerateStream(0.0)
        _finish(stream, meta)
        result = stream.result(1.0, done=True)
        assert result.server_ttft_s is None and result.reuse is None, meta


def test_the_record_keeps_them_and_reads_logs_written_without_them() -> None:
    stream = GenerateStream(10.0)
    _finish(stream, {"ttft": 0.25, "reuse": REUSE})
    record = RequestRecord.of(3, 1, 0, stream.result(11.0, done=True), 9.0, 40)
    data = record.to_json()
    assert data["server_ttft_s"] == 0.25 and data["reuse"] == REUSE
    assert RequestRecord.from_json(data) == record
    old = {k: v for k, v in data.items() if k not in ("server_ttft_s", "reuse")}
    restored = RequestRecord.from_json(old)
    assert restored.server_ttft_s is None and restored.reuse is None
