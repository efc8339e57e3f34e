"""The bench client carries extra body fields (cache hints) and reads their outcomes."""

from __future__ import annotations

from hicache.bench.client import ApiStyle, BenchClient, GenerateStream, OpenAIStream

HINTS = [{"kind": "retain", "ttl_s": 60.0}]
OUTCOMES = [{"index": 0, "kind": "retain", "outcome": "accepted", "tokens": 64,
             "clipped_tokens": 0, "reason": ""}]


def test_extra_fields_join_the_body_of_either_api() -> None:
    generate = BenchClient("http://x", ApiStyle.GENERATE)
    route, body = generate.payload([1, 2, 3], 4, {"hicache_hints": HINTS})
    assert route == "/generate" and body["input_ids"] == [1, 2, 3]
    assert body["hicache_hints"] == HINTS
    assert "hicache_hints" not in generate.payload([1, 2, 3], 4)[1]
    openai = BenchClient("http://x", ApiStyle.OPENAI, model="m")
    route, body = openai.payload("hi", 4, {"hicache_hints": HINTS})
    assert route == "/v1/completions" and body["hicache_hints"] == HINTS


def test_hint_outcomes_are_read_from_meta_info_and_the_openai_top_level() -> None:
    stream = GenerateStream(0.0)
    stream.feed({"text": "a", "output_ids": [5], "meta_info": {
        "completion_tokens": 1, "finish_reason": {"type": "length"}, "hints": OUTCOMES}}, 1.0)
    assert stream.result(1.0, done=True).hints == OUTCOMES
    plain = GenerateStream(0.0)
    plain.feed({"text": "a", "output_ids": [5], "meta_info": {
        "completion_tokens": 1, "finish_reason": {"type": "length"}}}, 1.0)
    assert plain.result(1.0, done=True).hints is None
    openai = OpenAIStream(0.0)
    openai.feed({"choices": [{"text": "a", "finish_reason": "length"}],
                 "hicache_hints": OUTCOMES}, 1.0)
    assert openai.result(1.0, done=True).hints == OUTCOMES
