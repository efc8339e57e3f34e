"""What a request's fields ask its output to match, as the engine's ``GrammarSpec``.

- SGLang's ``json_schema`` (JSON text or an object), ``regex`` and ``ebnf`` sampling
  parameters (``/generate``, and the OpenAI endpoints' extensions): at most one of them.
- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type":
  "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name":
  ..., "schema": {...}, "strict": ...}}`` (that schema; enforced whatever ``strict`` says:
  the grammar makes every output valid, so there is nothing a non-strict mode would allow).
- ``tool_choice: "required"`` or a named function: the output is one or more tool calls in
  the Hermes format ``tool_parser`` reads back (``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``), each naming an offered function (the named one) with arguments
  valid against its ``parameters`` schema; ``parallel_tool_calls: false`` allows exactly one.

Refusals are ``ValueError`` (a 400 from request validation); a spec that the engine then
cannot compile (a bad regex, an unsupported schema) is a 400 from the engine's check.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.engine.api import GrammarSpec, RequestError

# The calls one constrained answer may hold with parallel tool calls (the grammar spells
# each count out). Small: a small model, once forced, tends to repeat its call until the
# grammar stops it, and each repeat costs its tokens (SmolLM2: about 40 a call).
MAX_PARALLEL_CALLS = 4


def sampling_grammar(json_schema: Any, regex: Any, ebnf: Any) -> GrammarSpec | None:
    """SGLang's three constraint parameters (None or "" where not given)."""
    given = {name: value for name, value in
             (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf))
             if value not in (None, "")}
    if len(given) > 1:
        raise ValueError(f"give one of json_schema, regex and ebnf, not {sorted(given)}")
    if not given:
        return None
    (name, value), = given.items()
    if name == "json_schema":
        return _schema_spec(value, "json_schema")
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return GrammarSpec("regex" if name == "regex" else "ebnf", value)


def response_format_grammar(response_format: Any) -> GrammarSpec | None:
    """OpenAI's ``response_format`` (None: text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ValueError(
                "response_format json_schema needs a json_schema object with a schema"
            )
        return _schema_spec(spec["schema"], "response_format.json_schema.schema")
    raise ValueError(
        f"response_format type {kind!r} is not supported: one of text, json_object, "
        "json_schema"
    )


def tool_call_grammar(
    functions: Sequence[tuple[str, Mapping[str, Any] | None]], parallel: bool
) -> GrammarSpec:
    """An answer of tool calls, each to one of ``functions`` ((name, parameters schema)),
    one only unless ``parallel``. The spec's text is an EBNF grammar whose calls are JSON
    schemas: it is built here as a JSON description that ``Grammars`` compiles."""
    if not functions:
        raise ValueError("a forced tool call needs the tools it may call")
    calls = []
    for name, parameters in functions:
        calls.append({
            "type": "object",
            "properties": {"name": {"const": name},
                           "arguments": dict(parameters) if parameters else {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # (Not key-sorted: each call writes its name first, then its arguments, as declared.)
    text = json.dumps({"call_schema": schema, "max_calls": MAX_PARALLEL_CALLS if parallel else 1})
    return GrammarSpec("tool_calls", text)


def one_grammar(*specs: GrammarSpec | None) -> GrammarSpec | None:
    """The one constraint a request's fields give; ValueError when several do."""
    given = [spec for spec in specs if spec is not None]
    if len(given) > 1:
        raise ValueError(
            f"the output can match one constraint, this request gives {len(given)} "
            f"({', '.join(spec.kind for spec in given)})"
        )
    return given[0] if given else None


def _schema_spec(value: Any, what: str) -> GrammarSpec:
    try:
        return GrammarSpec.json_schema(value)
    except RequestError as error:
        raise ValueError(f"{what}: {error}") from error
