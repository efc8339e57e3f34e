"""Grammar-constrained decoding: compiling specs (bad ones refused before anything is
queued), the batched mask, and the engine's output matching a regex, a JSON schema and an
EBNF grammar, greedy and sampled, beside unconstrained requests, from a cached prefix."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
import torch

from hicache.engine.api import (
    GenerateRequest,
    GrammarSpec,
    LogprobParams,
    RequestError,
    SamplingParams,
)
from hicache.engine.engine import Engine
from hicache.engine.grammar import Grammars, mask_logits
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.engine_helpers import run, run_many

PAGE = 16
FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "4096")
VOCAB = 512  # the tiny preset's: past the byte tokenizer's 262 ids

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                   "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
    "required": ["ok", "level", "tag"],
    "additionalProperties": False,
}


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def check_schema(value: object) -> None:
    """SCHEMA by hand (jsonschema is not a dependency)."""
    assert isinstance(value, dict) and set(value) == {"ok", "level", "tag"}
    assert isinstance(value["ok"], bool) and value["level"] in (1, 2, 3)
    assert re.fullmatch(r"[a-z]{2,4}", value["tag"])


@pytest.fixture(name="grammars")
def grammars_fixture() -> Grammars:
    return Grammars(ByteTokenizer(), VOCAB)


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("regex", "[a-"), "invalid regex"),
    (GrammarSpec("ebnf", "root ::= "), "invalid ebnf"),
    (GrammarSpec("json_schema", '{"type": "object"'), "invalid json_schema"),
    (GrammarSpec("ebnf", 'start ::= "a"'), "invalid ebnf"),  # no root rule
])
def test_a_spec_that_does_not_compile_is_a_request_error(
    grammars: Grammars, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        grammars.compile(spec)


def test_schema_specs_keep_their_order_and_compile_once(grammars: Grammars) -> None:
    # The same schema as an object and as JSON text is one spec; its keys keep their
    # order, which is the order the output writes the properties in.
    a = GrammarSpec.json_schema({"type": "object", "required": ["x"]})
    b = GrammarSpec.json_schema('{"type": "object", "required": ["x"]}')
    assert a == b and a.text.index('"type"') < a.text.index('"required"')
    assert grammars.compile(a) is grammars.compile(b)
    with pytest.raises(RequestError, match="not valid JSON"):
        GrammarSpec.json_schema("{")
    with pytest.raises(RequestError, match="must be a JSON object"):
        GrammarSpec.json_schema([1])


def test_the_mask_allows_only_what_each_rows_grammar_allows(grammars: Grammars) -> None:
    tokenizer = ByteTokenizer()
    eos = tokenizer.eos_token_ids
    state = grammars.state(GrammarSpec("regex", "ab?"))
    logits = torch.randn(3, VOCAB)
    raw = logits.clone()
    mask_logits(logits, [1], [state])
    # Rows without a grammar are untouched; row 1 allows 'a' alone (not eos: "" is no match).
    assert torch.equal(logits[0], raw[0]) and torch.equal(logits[2], raw[2])
    allowed = logits[1].isfinite().nonzero().flatten().tolist()
    assert allowed == [ord("a")]
    assert state.accept(ord("a"))
    logits = torch.randn(1, VOCAB)
    mask_logits(logits, [0], [state])
    allowed = logits[0].isfinite().nonzero().flatten().tolist()
    assert allowed == sorted([ord("b"), *eos])  # "a" matches: it may end
    assert not state.accept(ord("c")) and not state.terminated
    assert state.accept(ord("b")) and not state.terminated
    assert state.accept(eos[0]) and state.terminated


def test_regex_output_fullmatches_greedy_and_sampled(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(*FLAGS)
    pattern = r"[0-9]{3}-[a-z]{2,3}"
    spec = GrammarSpec("regex", pattern)
    greedy = run(engine, prompt(1, 40), max_new_tokens=32, grammar=spec)
    assert re.fullmatch(pattern, greedy.text), greedy.text
    # It ends when the grammar does: on an eos token the grammar allowed.
    assert greedy.last.finish_reason == "stop"
    assert greedy.token_ids[-1] in engine.tokenizer.eos_token_ids
    for seed in range(3):
        sampled = run(engine, prompt(2, 40), max_new_tokens=32, grammar=spec,
                      temperature=1.0, seed=seed)
        assert re.fullmatch(pattern, sampled.text), sampled.text
        assert sampled.last.finish_reason == "stop"


def test_json_schema_output_validates_and_leaves_other_rows_alone(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = prompt(3, 50)
    alone = run(engine, prompt(4, 50), max_new_tokens=12, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=64, grammar=spec)
    plain = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    runs = run_many(engine, [
        GenerateRequest(tuple(ids), params),
        GenerateRequest(tuple(prompt(4, 50)), plain),
        GenerateRequest(tuple(ids), SamplingParams(temperature=0.7, seed=5, top_k=20,
                                                   max_new_tokens=64, grammar=spec)),
    ])
    for constrained in (runs[0], runs[2]):
        check_schema(json.loads(constrained.text))
        assert constrained.last.finish_reason == "stop"
    # The unconstrained row of the same batches drew what it draws alone.
    assert runs[1].token_ids == alone.token_ids


def test_a_cached_prefix_changes_nothing(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(6, 70)
    spec = GrammarSpec("ebnf", 'root ::= "say " ("yes" | "no") " " [a-z] [a-z]? "."')
    cold = run(engine, ids, max_new_tokens=24, grammar=spec)
    warm = run(engine, ids, max_new_tokens=24, grammar=spec)
    assert warm.last.cached_tokens.total == 64
    assert warm.token_ids == cold.token_ids
    assert re.fullmatch(r"say (yes|no) [a-z]{1,2}\.", cold.text), cold.text
    assert cold.last.finish_reason == "stop"


def test_a_bad_grammar_is_refused_before_anything_is_queued(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    with pytest.raises(RequestError, match="invalid regex"):
        run(engine, prompt(7, 10), grammar=GrammarSpec("regex", "(unclosed"))
    assert engine.scheduler.counters.num_requests == 0


def test_stop_strings_and_logprobs_with_a_grammar(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(*FLAGS)
    spec = GrammarSpec("regex", r"[a-z]{3}-[0-9]{3}")
    ids = prompt(8, 40)
    whole = run(engine, ids, max_new_tokens=16, grammar=spec)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{3}", whole.text), whole.text
    # A stop string ends it inside the grammar's match, cut as any stop string is.
    cut = run(engine, ids, max_new_tokens=16, grammar=spec, stop=("-",))
    assert cut.text == whole.text.split("-")[0] and cut.last.finish_reason == "stop"
    # Logprobs are of the raw distribution: the chosen token's, whatever the mask forbade,
    # and the top tokens may be ones the grammar never allowed.
    params = SamplingParams(temperature=0.0, max_new_tokens=16, grammar=spec)
    raw = run(engine, ids, logits=True, max_new_tokens=16, grammar=spec)
    [logged] = run_many(engine, [GenerateRequest(tuple(ids), params,
                                                 logprobs=LogprobParams(top_n=3))])
    out = [lp for o in logged.outputs for lp in o.output_logprobs]
    assert [lp.token_id for lp in out] == whole.token_ids == raw.token_ids
    assert len(raw.logits) == len(out)
    first = out[0]
    assert first.logprob is not None and first.logprob <= first.top[0][1]
    # The masked row (what the token was drawn from) puts all its mass on the 26 letters:
    # the chosen token's logprob there is higher than the raw one reported.
    masked = torch.log_softmax(raw.logits[0], dim=-1)[first.token_id]
    assert first.logprob < float(masked) - 1e-3


def test_a_retracted_request_keeps_its_matcher_in_step(make_engine: Callable[..., Engine]) -> None:
    # Four constrained requests whose prompts fit together but whose outputs do not: some
    # are retracted mid-decode and resume with the output (and matcher) they had.
    flags = ("--page-size", "4", "--max-total-tokens", "256")
    spec = GrammarSpec("regex", r"[a-z]{60}x")
    ids = [prompt(300 + i, 40) for i in range(4)]
    solo_engine = make_engine(*flags)
    solo = [run(solo_engine, p, max_new_tokens=70, grammar=spec).token_ids for p in ids]
    solo_engine.shutdown()
    engine = make_engine(*flags)
    params = SamplingParams(temperature=0.0, max_new_tokens=70, grammar=spec)
    results = run_many(engine, [GenerateRequest(tuple(p), params) for p in ids])
    assert engine.scheduler.counters.num_retractions > 0
    assert [r.token_ids for r in results] == solo
    for r in results:
        assert re.fullmatch(r"[a-z]{60}x", r.text) and r.last.finish_reason == "stop"
