"""Every L3 failure reason the code can count has a description for the operator.

The registry (``failure_reasons.FailureReason``) is the only way to count a
failure: the counting methods are typed to take its members (or a
``frame.Fault``, whose values are members too). Here: every member has a
meaning; every ``Fault`` value and every reason a backend derives from its
store's error codes is a member; and no code in the storage package counts a
bare string (a scan of every call that counts a reason). End to end, a FIFO put
in place of a page file is logged with what it means, where the log used to say
"a failure reason this server has no description for".
"""

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import hicache.storage as storage_package
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.mooncake.client import _REASONS as MOONCAKE_REASONS
from hicache.storage.backends.mooncake.client import failure_reason
from hicache.storage.failure_log import FailureLog
from hicache.storage.failure_reasons import (
    MEANINGS,
    UNDESCRIBED,
    FailureReason,
    meaning,
    raised_reason,
)
from hicache.storage.frame import Fault, object_name

# Calls that count a reason: the reason's argument position.
COUNTING_CALLS = {"fail": 0, "_fail": 0, "_note_backup_failed": 1, "TransferFailed": 0,
                  "Outcome": 1, "_mark_bad": 1}


def test_every_reason_has_a_meaning() -> None:
    assert set(MEANINGS) == set(FailureReason)
    for reason in FailureReason:
        text = meaning(reason.value)
        assert text != UNDESCRIBED and len(text) > 20, reason
    assert meaning("not_regular_file") != UNDESCRIBED  # the one the log could not explain


def test_faults_and_derived_reasons_are_registered() -> None:
    registered = {reason.value for reason in FailureReason}
    assert {fault.value for fault in Fault} <= registered
    for code in [*MOONCAKE_REASONS, -4242]:
        assert isinstance(failure_reason(code), FailureReason)
    for call in ("exists", "get", "set", "discard"):
        assert raised_reason(call).value == f"{call}_raised"


def _storage_sources() -> list[Path]:
    return sorted(Path(storage_package.__file__).parent.rglob("*.py"))


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


def test_no_code_counts_a_reason_spelt_as_a_string() -> None:
    literal_reasons: list[str] = []
    for path in _storage_sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node) in COUNTING_CALLS:
                position = COUNTING_CALLS[_called_name(node) or ""]
                if len(node.args) > position:
                    argument = node.args[position]
                    for inner in ast.walk(argument):
                        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                            literal_reasons.append(f"{path.name}:{node.lineno} {inner.value!r}")
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and \
                    node.value.value in {r.value for r in FailureReason}:
                literal_reasons.append(f"{path.name}:{node.lineno} returns {node.value.value!r}")
    assert literal_reasons == []


def test_a_fifo_page_is_logged_with_what_it_means(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    host = HostPool(geometry, 4, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = FileBackend({"path": str(tmp_path / "l3")})
    backend.attach(host)
    key = bytes(range(16))
    name = object_name(key, backend._ready([]).order)
    fifo = tmp_path / "l3" / name[:2] / name
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    assert backend.get([key], np.array([0])) == 0
    failures = backend.stats().failures
    assert failures == {"not_regular_file": 1}
    caplog.set_level(logging.WARNING, logger="hicache.storage.failure_log")
    FailureLog("file").observe("backend", failures)
    [line] = [r.getMessage() for r in caplog.records]
    assert "'not_regular_file' x1" in line
    assert UNDESCRIBED not in line and "not a regular file" in line
    backend.close()
