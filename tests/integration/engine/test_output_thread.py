"""Outputs are detokenized and streamed on the output thread, beside the scheduler.

The scheduler thread only records each request's new tokens; the output thread
detokenizes them and delivers them. Requests with stop strings are the exception
(whether they stop depends on their text): the scheduler detokenizes those. What a
client receives, chunk by chunk, is the same as with everything on the scheduler
thread (``--disable-output-thread``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch

import hicache.engine.engine as engine_module
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.detokenizer import IncrementalDetokenizer
from tests.engine_helpers import Run, run, run_many

FLAGS = ("--page-size", "4", "--max-total-tokens", "2048")


def prompt(seed: int, length: int = 30) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def request(ids: list[int], **sampling: object) -> GenerateRequest:
    params = SamplingParams(**{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True,  # type: ignore[arg-type]
                               **sampling})
    return GenerateRequest(tuple(ids), params)


def workload(engine: Engine) -> list[GenerateRequest]:
    """Greedy and seeded requests, stop strings, a stop token, min_new_tokens."""
    free = run(engine, prompt(2), max_new_tokens=12, ignore_eos=True)
    assert len(free.text) > 5  # the tiny model answers it with some text
    stop_text = free.text[3:5]
    return [
        request(prompt(1)),  # characters split over tokens: text held back
        request(prompt(5), temperature=0.9, seed=7),
        request(prompt(2), stop=(stop_text,)),
        request(prompt(2), stop=(stop_text, "\x00\x01"), min_new_tokens=5),
        request(prompt(2), stop_token_ids=(free.token_ids[4],), ignore_eos=False),
        request(prompt(4), max_new_tokens=1),
    ]


def chunks(result: Run) -> list[tuple[tuple[int, ...], str, bool, str | None, int]]:
    return [(o.token_ids, o.text, o.finished, o.finish_reason, o.completion_tokens)
            for o in result.outputs]


def test_clients_get_the_same_outputs_with_and_without_the_output_thread(
    make_engine: Callable[..., Engine],
) -> None:
    threaded = make_engine(*FLAGS)
    inline = make_engine(*FLAGS, "--disable-output-thread")
    assert threaded.scheduler.outputs.threaded and not inline.scheduler.outputs.threaded
    requests = workload(threaded)
    assert requests == workload(inline)
    got = run_many(threaded, requests)
    want = run_many(inline, requests)
    for mine, reference in zip(got, want, strict=True):
        assert chunks(mine) == chunks(reference)
    reasons = [r.last.finish_reason for r in got]
    assert reasons[2] == "stop" and reasons[4] == "stop" and reasons[0] == "length"
    assert all(r.last.error is None for r in got)
    threaded.check_integrity()


class _ThreadRecordingDetokenizer(IncrementalDetokenizer):
    """Notes the thread of every push, per prompt."""

    seen: ClassVar[dict[tuple[int, ...], set[str]]] = {}

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        super().__init__(tokenizer, prompt_ids)
        self._key = tuple(prompt_ids)

    def push(self, token_ids: object) -> str:
        self.seen.setdefault(self._key, set()).add(threading.current_thread().name)
        return super().push(token_ids)  # type: ignore[arg-type]


@pytest.mark.parametrize("threaded", [True, False])
def test_only_stop_strings_are_detokenized_on_the_scheduler_thread(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, threaded: bool,
) -> None:
    engine = make_engine(*FLAGS, *(() if threaded else ("--disable-output-thread",)))
    monkeypatch.setattr(_ThreadRecordingDetokenizer, "seen", {})
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", _ThreadRecordingDetokenizer)
    plain, stopping = prompt(10), prompt(11)
    results = run_many(engine, [request(plain), request(stopping, stop=("\x00\x00\x00",))])
    assert [len(r.token_ids) for r in results] == [12, 12]
    seen = _ThreadRecordingDetokenizer.seen
    assert seen[tuple(stopping)] == {"hicache-scheduler"}
    assert seen[tuple(plain)] == {"hicache-output" if threaded else "hicache-scheduler"}
