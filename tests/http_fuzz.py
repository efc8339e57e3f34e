"""Seeded hostile requests for the serving API: the input of the HTTP fuzz test.

``fuzz_cases(seed, count, model)`` gives the same list for the same arguments:
first ``pinned_cases`` (every extreme worth a name, so each runs in every
session whatever the seed), then random mutations of small valid requests to
/generate, /v1/completions and /v1/chat/completions until ``count``. A
mutation changes one thing (a number to an extreme, a field to a wrong type, a
prompt, the messages, the stop list, streaming, an unknown field ...); a case
gets one to three. The label of a case says what was done, so a failure
report reads as a list of reproducible requests.

Valid requests ask for a few tokens only: a fuzz case that the server accepts
must be cheap to serve, or a few hundred of them would not fit in a test.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (GENERATE, COMPLETIONS, CHAT)

MEGABYTE = 1 << 20
# Special-token spellings of common tokenizers (the byte tokenizer of dummy models
# knows the <|...|> ones); a prompt full of them is a tokenizer's worst case.
SPECIAL_STRINGS = ("<|eos|>", "<|end|>", "<|bos|>", "<|assistant|>", "<|user|>",
                   "<|im_end|>", "<|endoftext|>", "</s>", "<s>")
# Few tokens: an accepted case costs little to serve.
SMALL_MAX_TOKENS = (1, 2, 4, 8)


@dataclass(frozen=True)
class FuzzCase:
    label: str  # what was done to the request (for the failure report)
    route: str
    body: bytes  # sent as is, with Content-Type: application/json

    def describe(self, limit: int = 160) -> str:
        shown = self.body[:limit].decode("utf-8", errors="replace")
        more = f"... ({len(self.body)} bytes)" if len(self.body) > limit else ""
        return f"{self.route} [{self.label}] {shown}{more}"


def encode(body: Any) -> bytes:
    # NaN and Infinity are written as the bare words, which JSON does not have: the
    # server must refuse them cleanly, or read them as numbers and refuse those. Non-ASCII
    # characters (a lone surrogate too) go as \u escapes.
    return json.dumps(body, allow_nan=True).encode("ascii")


def base_request(route: str, model: str, rng: random.Random) -> dict[str, Any]:
    """A small valid request to ``route`` (a few tokens, greedy or sampled)."""
    max_tokens = rng.choice(SMALL_MAX_TOKENS)
    if route == GENERATE:
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": max_tokens}}
        if rng.random() < 0.5:
            body["text"] = rng.choice(SHORT_TEXTS)
        else:
            body["input_ids"] = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))]
        return body
    if route == COMPLETIONS:
        return {"model": model, "prompt": rng.choice(SHORT_TEXTS), "max_tokens": max_tokens}
    return {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": rng.choice(SHORT_TEXTS)}]}


SHORT_TEXTS = ("hello", "The capital of France is", "a b c d e f g", "Ünïcödé ✓ 日本語 🚀",
               "line\nbreaks\tand\ttabs", "x")


def sampling(body: dict[str, Any], route: str) -> dict[str, Any]:
    """Where ``body`` keeps its sampling fields (/generate nests them)."""
    if route != GENERATE:
        return body
    params = body.setdefault("sampling_params", {})
    if not isinstance(params, dict):
        params = body["sampling_params"] = {}
    return params


def max_tokens_field(route: str) -> str:
    return "max_new_tokens" if route == GENERATE else "max_tokens"


# ------------------------------------------------------------------ value pools
EXTREME_NUMBERS: tuple[Any, ...] = (
    0, -0.0, 1e-40, 1e-300, 5e-324, 1e-7, 1e308, -1, -1e-40, 1.5, 2**31, 2**63 - 1, 2**63,
    2**64, 10**100, float("nan"), float("inf"), float("-inf"),
)
NAN_LIKE_STRINGS = ("NaN", "nan", "inf", "-Infinity", "1e-40", "0x10", "", " ")
WRONG_TYPES: tuple[Any, ...] = (None, True, "4", [], {}, [1, 2], {"a": 1}, "null")
TOKEN_ID_LISTS: tuple[Any, ...] = (
    [], [0], [-1], [1, 2, 3], [255, 256, 257, 261], [262], [1 << 40], [2**63], [2**64],
    [10**30], [1.0], [True], ["1"], [[1, 2]], [None], [1] * 2000,
)
STOPS: tuple[Any, ...] = (
    "", [""], "<|eos|>", ["a", "b"], 7, [1], None, "x" * 10_000, ["s"] * 1000, {"a": 1},
)
BAD_MESSAGES: tuple[Any, ...] = (
    [], [{}], [{"role": "user"}], [{"content": "hi"}], [{"role": "robot", "content": "hi"}],
    [{"role": "user", "content": 3}], [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"text": "no type"}]}],
    [{"role": "user", "content": "hi", "name": 5}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
    [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "hi"}] * 200, "hi", {"role": "user"}, [["user", "hi"]],
)


def special_text(size_bytes: int, rng: random.Random) -> str:
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        piece = rng.choice(SPECIAL_STRINGS) if rng.random() < 0.8 else rng.choice("ab <|>")
        parts.append(piece)
        total += len(piece)
    return "".join(parts)


# Prompts for random cases: small to mid-sized, odd characters, special tokens.
PROMPT_TEXTS = (
    "", " ", "\x00", "\ud800", "\ufeff", "😀" * 100, "<|eos|>", "".join(SPECIAL_STRINGS),
    special_text(2_000, random.Random(1)), special_text(16_000, random.Random(2)),
    "lorem ipsum " * 1000,
)


# ------------------------------------------------------------------ mutations
Mutation = Callable[[dict[str, Any], str, random.Random], str]


def set_number(body: dict[str, Any], route: str, rng: random.Random) -> str:
    field = rng.choice(("temperature", "top_p", "top_k", "seed", max_tokens_field(route)))
    value = rng.choice(EXTREME_NUMBERS + NAN_LIKE_STRINGS)
    sampling(body, route)[field] = value
    return f"{field}={value!r}"


def set_wrong_type(body: dict[str, Any], route: str, rng: random.Random) -> str:
    in_sampling = ["ignore_eos", "stop_token_ids", "temperature", max_tokens_field(route)]
    fields = in_sampling + ["stream"] + {
        GENERATE: ["text", "input_ids", "sampling_params", "return_logprob"],
        COMPLETIONS: ["prompt", "model", "echo", "n", "stream_options", "logit_bias"],
        CHAT: ["messages", "model", "tools", "response_format", "tool_choice"],
    }[route]
    field = rng.choice(fields)
    value = rng.choice(WRONG_TYPES)
    target = sampling(body, route) if field in in_sampling else body
    target[field] = value
    return f"{field} as {type(value).__name__} {value!r}"


def put_prompt(body: dict[str, Any], route: str, text: str) -> None:
    if route == GENERATE:
        body.pop("input_ids", None)
        body["text"] = text
    elif route == COMPLETIONS:
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]


def set_prompt(body: dict[str, Any], route: str, rng: random.Random) -> str:
    text = rng.choice(PROMPT_TEXTS)
    put_prompt(body, route, text)
    return f"prompt of {len(text)} chars {text[:20]!r}"


def set_token_ids(body: dict[str, Any], route: str, rng: random.Random) -> str:
    ids = rng.choice(TOKEN_ID_LISTS)
    if route == GENERATE:
        body.pop("text", None)
        body["input_ids"] = ids
    elif route == COMPLETIONS:
        body["prompt"] = ids if rng.random() < 0.8 else [ids]
    else:
        sampling(body, route)["stop_token_ids"] = ids
        return f"stop_token_ids={str(ids)[:40]}"
    return f"token ids {str(ids)[:40]}"


def set_stop(body: dict[str, Any], route: str, rng: random.Random) -> str:
    stop = rng.choice(STOPS)
    sampling(body, route)["stop"] = stop
    return f"stop={str(stop)[:30]}"


def set_messages(body: dict[str, Any], route: str, rng: random.Random) -> str:
    if route != CHAT:
        return set_prompt(body, route, rng)
    messages = rng.choice(BAD_MESSAGES)
    body["messages"] = copy.deepcopy(messages)
    return f"messages={str(messages)[:60]}"


def set_stream(body: dict[str, Any], route: str, rng: random.Random) -> str:
    body["stream"] = True
    if route != GENERATE and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.random() < 0.7}
    return "stream" + (f" stream_options={body['stream_options']}" if "stream_options" in body
                       else "")


def add_unknown_field(body: dict[str, Any], route: str, rng: random.Random) -> str:
    name = rng.choice(("max_token", "temprature", "foo", "", "__proto__", "logprobs_num", "n "))
    target = sampling(body, route) if rng.random() < 0.5 else body
    target[name] = rng.choice((1, "x", None, {"nested": [1]}))
    return f"unknown field {name!r}"


def drop_field(body: dict[str, Any], route: str, rng: random.Random) -> str:
    names = [name for name in body if name != "sampling_params"] or ["model"]
    name = rng.choice(names)
    body.pop(name, None)
    return f"without {name}"


def set_model(body: dict[str, Any], route: str, rng: random.Random) -> str:
    name = rng.choice(("", "other-model", "../../etc/passwd", "x" * 5000, None))
    body["model"] = name
    return f"model={str(name)[:20]!r}"


MUTATIONS: tuple[Mutation, ...] = (
    set_number, set_number, set_number, set_wrong_type, set_prompt, set_token_ids, set_stop,
    set_messages, set_stream, set_stream, add_unknown_field, drop_field, set_model,
)


def malformed_body(rng: random.Random, valid: bytes) -> tuple[str, bytes]:
    """A body that is not the JSON object a route expects."""
    choice = rng.randrange(9)
    if choice == 0:
        cut = rng.randrange(1, max(2, len(valid)))
        return f"truncated at {cut}", valid[:cut]
    if choice == 1:
        return "invalid UTF-8", b'{"prompt": "\xff\xfe\xc3"}'
    if choice == 2:
        return "top-level " + (kind := rng.choice(("array", "string", "number", "null"))), {
            "array": b"[1, 2, 3]", "string": b'"hello"', "number": b"42", "null": b"null"}[kind]
    if choice == 3:
        depth = rng.choice((100, 10_000, 100_000))
        return f"nested {depth} deep", b"[" * depth + b"]" * depth
    if choice == 4:
        return "NaN literal", valid.replace(b"{", b'{"temperature": NaN, ', 1)
    if choice == 5:
        return "byte order mark", b"\xef\xbb\xbf" + valid
    if choice == 6:
        return "duplicate keys", valid.replace(b"{", b'{"stream": true, ', 1)
    if choice == 7:
        return "huge number literal", valid.replace(b"{", b'{"temperature": 1e400, ', 1)
    return "whitespace only", b" \n\t "


def random_case(rng: random.Random, model: str) -> FuzzCase:
    route = rng.choice(ROUTES)
    body = base_request(route, model, rng)
    if rng.random() < 0.12:
        label, raw = malformed_body(rng, encode(body))
        return FuzzCase(label, route, raw)
    labels = [rng.choice(MUTATIONS)(body, route, rng) for _ in range(rng.choice((1, 1, 2, 3)))]
    return FuzzCase("; ".join(labels), route, encode(body))


def pinned_cases(model: str, rng: random.Random) -> list[FuzzCase]:
    """Every named extreme once per route where it applies."""
    cases: list[FuzzCase] = []

    def add(label: str, route: str, change: Callable[[dict[str, Any]], None]) -> None:
        body = base_request(route, model, random.Random(len(cases)))
        change(body)
        cases.append(FuzzCase(label, route, encode(body)))

    for route in ROUTES:
        for temperature in (1e-40, 1e-300, 5e-324, -0.0):
            for stream in (False, True):
                def tiny(body: dict[str, Any], t: float = temperature, s: bool = stream,
                         r: str = route) -> None:
                    sampling(body, r)["temperature"] = t
                    body["stream"] = s
                add(f"temperature={temperature!r} stream={stream}", route, tiny)
        for value in (2**31, 10**100, None):
            def max_tokens(body: dict[str, Any], v: Any = value, r: str = route) -> None:
                sampling(body, r)[max_tokens_field(r)] = v
                body["stream"] = True
            add(f"{max_tokens_field(route)}={value!r} stream", route, max_tokens)
        for text, what in (("x" * MEGABYTE, "megabyte plain"),
                           (special_text(MEGABYTE, rng), "megabyte of special tokens"),
                           ("", "empty"), ("\ud800", "lone surrogate")):
            def prompt(body: dict[str, Any], t: str = text, r: str = route) -> None:
                put_prompt(body, r, t)
            add(f"{what} prompt", route, prompt)
    return cases


def fuzz_cases(seed: int, count: int, model: str) -> list[FuzzCase]:
    """``count`` cases (at least the pinned ones), the same for the same arguments."""
    rng = random.Random(seed)
    cases = pinned_cases(model, rng)
    while len(cases) < count:
        cases.append(random_case(rng, model))
    rng.shuffle(cases)
    return cases
