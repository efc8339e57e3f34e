"""Prompt generation, conversations, arrivals and long-context datasets."""

from __future__ import annotations

import json
import statistics
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from hicache.bench.workload import (
    ArrivalDistribution,
    ByteCodec,
    JsonTokenizerCodec,
    Prompt,
    PromptMaker,
    PromptStyle,
    WorkloadError,
    arrival_gaps,
    concat,
    load_long_context,
    multiturn_sessions,
    synthetic_long_context,
    warmup_prompts,
    working_set_tokens,
)

TOKENS = PromptMaker(PromptStyle.TOKENS)
TEXT = PromptMaker(PromptStyle.TEXT)


@pytest.mark.parametrize("length", [0, 1, 7, 100, 2048])
def test_prompt_lengths_are_exact(length: int) -> None:
    rng = np.random.default_rng(0)
    ids = TOKENS.make(rng, length)
    assert isinstance(ids, list) and len(ids) == length
    assert all(0 <= t < 256 for t in ids)
    text = TEXT.make(rng, length)
    assert isinstance(text, str) and len(text.encode()) == length
    assert TEXT.count(text) == length


def test_token_id_range_is_respected() -> None:
    maker = PromptMaker(PromptStyle.TOKENS, token_low=1000, token_high=1010)
    ids = maker.make(np.random.default_rng(1), 500)
    assert set(ids) <= set(range(1000, 1010)) and len(set(ids)) > 5
    with pytest.raises(WorkloadError):
        PromptMaker(token_low=5, token_high=5)


def test_text_prompts_are_words() -> None:
    text = TEXT.make(np.random.default_rng(2), 300)
    assert isinstance(text, str) and text.startswith(" ")
    words = text.split()
    assert len(words) > 20 and all(w.isalpha() for w in words[:-1])


def test_sessions_are_deterministic_per_seed() -> None:
    def prompts(seed: int) -> list[list[Prompt]]:
        sessions = multiturn_sessions(3, 4, 64, 16, 8, TOKENS, seed)
        return [s.parts for s in sessions]

    assert prompts(5) == prompts(5)
    assert prompts(5) != prompts(6)
    # Clients do not share prompts (or the cache would do the benchmark's work).
    first = [str(p[0]) for p in prompts(5)]
    assert len(set(first)) == 3


def test_session_rounds_append_answer_and_question() -> None:
    (session,) = multiturn_sessions(1, 3, 10, 4, 2, TOKENS, 0)
    plan0 = session.next_request()
    assert plan0.round == 0 and plan0.max_tokens == 2 and len(plan0.prompt) == 10
    session.record_answer("xy", [7, 8])
    plan1 = session.next_request()
    assert plan1.round == 1
    assert plan1.prompt == [*plan0.prompt, 7, 8, *session.parts[1]]
    # Without ids the answer text is re-encoded with the codec (bytes by default).
    session.record_answer("AB", None)
    plan2 = session.next_request()
    assert plan2.prompt == [*plan1.prompt, 65, 66, *session.parts[2]]
    session.record_answer("", [])
    assert session.done
    with pytest.raises(WorkloadError):
        session.next_request()


def test_text_sessions_append_text() -> None:
    (session,) = multiturn_sessions(1, 2, 20, 5, 3, TEXT, 0)
    first = session.next_request().prompt
    session.record_answer(" answer", [1, 2, 3])
    assert session.next_request().prompt == f"{first} answer{session.parts[1]}"


def test_concat_refuses_mixed_styles() -> None:
    assert concat([[1], [2, 3]]) == [1, 2, 3]
    assert concat(["a", "b"]) == "ab"
    with pytest.raises(WorkloadError):
        concat([[1], "b"])


def test_working_set() -> None:
    # 2 clients; final context = 100 + 2 * (10 + 20) = 160, plus its last answer.
    assert working_set_tokens(2, 3, 100, 20, 10) == 2 * 170


def test_warmup_prompts_differ_from_the_workload() -> None:
    warm = warmup_prompts(TOKENS, 2, 32, seed=0)
    session_prompts = [s.parts[0] for s in multiturn_sessions(4, 1, 32, 0, 1, TOKENS, 0)]
    assert len(warm) == 2 and all(len(p) == 32 for p in warm)
    assert not any(w == p for w in warm for p in session_prompts)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(WorkloadError):
        multiturn_sessions(0, 1, 10, 1, 1, TOKENS, 0)
    with pytest.raises(WorkloadError):
        multiturn_sessions(1, 1, 10, 1, 0, TOKENS, 0)
    with pytest.raises(WorkloadError):
        TOKENS.make(np.random.default_rng(0), -1)


# ------------------------------------------------------------------------ arrivals
def test_uniform_and_infinite_gaps() -> None:
    assert list(islice(arrival_gaps(ArrivalDistribution.UNIFORM, 4.0, 0), 3)) == [0.25] * 3
    assert list(islice(arrival_gaps(ArrivalDistribution.POISSON, float("inf"), 0), 3)) == [0] * 3
    with pytest.raises(WorkloadError):
        next(arrival_gaps(ArrivalDistribution.UNIFORM, 0.0, 0))


def test_poisson_gaps_have_the_rate_and_the_seed() -> None:
    gaps = list(islice(arrival_gaps(ArrivalDistribution.POISSON, 10.0, 1), 4000))
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.06)
    # Exponential: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.1)
    assert gaps[:5] == list(islice(arrival_gaps(ArrivalDistribution.POISSON, 10.0, 1), 5))
    assert gaps[:5] != list(islice(arrival_gaps(ArrivalDistribution.POISSON, 10.0, 2), 5))


# ------------------------------------------------------------------------ long context
def test_synthetic_long_context_shares_contexts_round_robin() -> None:
    data = synthetic_long_context(3, 200, 2, 10, TOKENS, seed=0)
    assert len(data.contexts) == 3 and all(len(c) == 200 for c in data.contexts)
    sessions = data.sessions(TOKENS, output_length=5)
    assert [s.group for s in sessions] == [0, 1, 2, 0, 1, 2]
    for s in sessions:
        plan = s.next_request()
        assert s.num_rounds == 1 and plan.max_tokens == 5 and len(plan.prompt) == 210
        assert plan.prompt[:200] == data.contexts[s.group]
    # Questions about one context differ.
    q = [s.parts[0][200:] for s in sessions if s.group == 0]
    assert q[0] != q[1]
    again = synthetic_long_context(3, 200, 2, 10, TOKENS, seed=0)
    assert again == data


def test_long_context_shuffle_and_limit() -> None:
    data = synthetic_long_context(2, 50, 5, 5, TOKENS, seed=1)
    shuffled = data.sessions(TOKENS, 1, interleave=False, seed=4)
    assert sorted(s.group for s in shuffled) == [0] * 5 + [1] * 5
    assert [s.group for s in shuffled] == [
        s.group for s in data.sessions(TOKENS, 1, interleave=False, seed=4)
    ]
    assert len(data.sessions(TOKENS, 1, num_queries=3)) == 3


def test_load_contexts_and_queries_json(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({
        "contexts": {"doc-a": "alpha " * 20, "doc-b": "beta " * 30},
        "queries": [
            {"context": "doc-a", "question": "What?", "reference_answer": "twelve chars"},
            {"context": "doc-b", "question": "Why?"},
        ],
    }))
    data = load_long_context(path, TEXT)
    assert data.contexts == ["alpha " * 20, "beta " * 30]
    assert [(q.context, q.question, q.max_tokens) for q in data.queries] == [
        (0, "\nWhat?", 12), (1, "\nWhy?", None)
    ]
    sessions = data.sessions(TEXT, output_length=7)
    assert sessions[0].next_request().prompt == "alpha " * 20 + "\nWhat?"
    assert [s.max_tokens for s in sessions] == [12, 7]
    # tokens style: the text becomes ids through the codec.
    ids = load_long_context(path, TOKENS)
    assert ids.contexts[0] == list(("alpha " * 20).encode())


def test_load_loogle_records(tmp_path: Path) -> None:
    records = [
        {"title": "t1", "input": "long document one",
         "qa_pairs": str([{"Q": "q1?", "A": "a1", "S": "evidence"}, {"Q": "q2?", "A": "a22"}])},
        {"title": "t2", "input": "document two", "qa_pairs": [{"Q": "q3?", "A": "a3"}]},
    ]
    path = tmp_path / "loogle.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    data = load_long_context(path, TEXT)
    assert data.contexts == ["long document one", "document two"]
    assert [(q.context, q.question) for q in data.queries] == [
        (0, "\nq1?"), (0, "\nq2?"), (1, "\nq3?")
    ]
    assert [q.max_tokens for q in data.queries] == [2, 3, 2]


@pytest.mark.parametrize("content, message", [
    ("{not json", "neither JSON"),
    (json.dumps({"contexts": ["x"], "queries": [{"context": 3, "question": "q"}]}), "unknown"),
    (json.dumps({"contexts": ["x"], "queries": []}), "no questions"),
    (json.dumps({"something": 1}), "expected"),
    (json.dumps([{"no_input": 1}]), "no 'input'"),
])
def test_bad_datasets_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        load_long_context(path, TEXT)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_long_context(tmp_path / "missing.json", TEXT)


def test_tokenizer_json_codec(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hicache.bench.workload import _WORDS

    # Word level: river=1, stone=2, cloud=3, ... (every word text prompts use).
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = JsonTokenizerCodec(tmp_path)  # the model directory
    assert codec.encode("river stone cloud") == [1, 2, 3]
    maker = PromptMaker(PromptStyle.TEXT, codec)
    text = maker.make(np.random.default_rng(0), 25)
    assert maker.count(text) == 25
    with pytest.raises(WorkloadError):
        JsonTokenizerCodec(tmp_path / "nowhere")
    assert ByteCodec().decode(ByteCodec().encode("héllo")) == "héllo"
