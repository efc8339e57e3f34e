"""``hicache bench grammar``: what grammar-constrained decoding costs, and how often its
answers are valid.

Mask cost (default): an in-process engine (``--model-path``, SmolLM2 by default; CPU)
runs ``--batch`` requests at once, every one constrained by a JSON schema, greedy, for
``--tokens`` tokens at most. Every call of the batched mask (``mask_logits``: fill each
row's bitmask, apply them) is timed, and so is each step; the report is the mean mask
time of the steps that masked every row, next to the mean step time, and their ratio.

Validity (``--url``, a running ``hicache serve``): ``--prompts`` varied chat prompts with
``tool_choice: "required"`` (two tools) and as many with a ``response_format`` json_schema,
``--concurrency`` at a time; a tool answer counts when it has ``finish_reason:
"tool_calls"`` and every call names an offered tool with arguments valid against its
schema (checked by hand), a JSON answer when it parses and validates.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SUBJECTS = ("Paris", "a cat", "the moon", "pizza", "a red car", "Tokyo", "my brother",
            "the ocean", "a violin", "winter", "Rome", "a small dog", "coffee", "a rainy day",
            "Mount Fuji", "a teacher", "chess", "the sun", "a bakery", "Berlin")
TEMPLATES = ("What is the weather in {s}?", "Tell me about {s}.", "Add 3 and {n}.",
             "Write a short poem about {s}.", "How far is {s} from here?")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"type": "string", "maxLength": 24},
                   "likes": {"type": "array", "items": {"type": "string", "maxLength": 16},
                             "maxItems": 3}},
    "required": ["name", "age", "city", "likes"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 32},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None,
                        help="model for the mask cost (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=64, help="most tokens per request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--url", default=None,
                        help="count valid answers from this server instead")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--json", default=None, help="write raw results here")


def prompts(count: int) -> list[str]:
    """``count`` prompts, each shape with each subject in turn (100 distinct)."""
    shapes = len(TEMPLATES)
    return [TEMPLATES[i % shapes].format(s=SUBJECTS[(i // shapes) % len(SUBJECTS)], n=i)
            for i in range(count)]


# ------------------------------------------------------------------ validity
def valid_person(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "city", "likes"}
            and isinstance(value["name"], str) and len(value["name"]) <= 24
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and isinstance(value["city"], str) and len(value["city"]) <= 24
            and isinstance(value["likes"], list) and len(value["likes"]) <= 3
            and all(isinstance(x, str) and len(x) <= 16 for x in value["likes"]))


def valid_call(name: str, arguments: str) -> bool:
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    if name == "get_weather":
        return (isinstance(args, dict) and set(args) == {"city", "unit"}
                and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit"))
    if name == "add":
        return (isinstance(args, dict) and set(args) == {"a", "b"}
                and all(type(v) is int for v in args.values()))
    return False


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def tool_answer_valid(url: str, prompt: str, max_tokens: int) -> bool:
    out = _post(url, {"messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
                      "tool_choice": "required", "temperature": 0, "max_tokens": max_tokens})
    choice = out["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return choice["finish_reason"] == "tool_calls" and bool(calls) and all(
        valid_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)


def json_answer_valid(url: str, prompt: str, max_tokens: int) -> bool:
    out = _post(url, {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                      "max_tokens": max_tokens, "response_format": {
                          "type": "json_schema",
                          "json_schema": {"name": "person", "schema": PERSON, "strict": True}}})
    try:
        return valid_person(json.loads(out["choices"][0]["message"]["content"] or ""))
    except json.JSONDecodeError:
        return False


def count_valid(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    checks: dict[str, Callable[[str, str, int], bool]] = {
        "tool_choice_required": tool_answer_valid, "json_schema": json_answer_valid}
    for name, check in checks.items():
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            valid = list(pool.map(lambda p, c=check: c(args.url, p, args.max_tokens),
                                  prompts(args.prompts)))
        results[name] = {"valid": sum(valid), "of": len(valid),
                         "seconds": round(time.monotonic() - started, 1)}
        print(f"{name:<22} {sum(valid)}/{len(valid)} valid "
              f"({results[name]['seconds']} s)")
    return results


# ------------------------------------------------------------------ mask cost
def mask_cost(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import hicache.engine.penalties as penalties
    from hicache.engine.api import GenerateRequest, GrammarSpec, SamplingParams
    from hicache.engine.build import build_engine
    from hicache.model.default_model import default_model_path
    from hicache.server.engine_args import add_engine_args, engine_config_from_args

    if args.threads:
        torch.set_num_threads(args.threads)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = args.model_path or str(default_model_path())
    engine = build_engine(engine_config_from_args(parser.parse_args(
        ["--model-path", model, "--device", "cpu", "--max-total-tokens", "8192"])))
    masks: list[tuple[int, float]] = []  # (rows, seconds) per call
    original = getattr(penalties, "mask_logits")  # noqa: B009 (swapped for a timed one)

    def timed(logits: Any, rows: Any, states: Any) -> None:
        started = time.perf_counter()
        original(logits, rows, states)
        masks.append((len(rows), time.perf_counter() - started))

    steps: list[float] = []
    scheduler = engine.scheduler
    forward_step = scheduler.forward_step

    def timed_step() -> int:
        started = time.perf_counter()
        result = forward_step()
        if result == 0:  # decode steps only (no prompt computed in them)
            steps.append(time.perf_counter() - started)
        return result

    setattr(penalties, "mask_logits", timed)  # noqa: B010
    setattr(scheduler, "forward_step", timed_step)  # noqa: B010
    try:
        engine.start()
        spec = GrammarSpec.json_schema(PERSON)
        tokenizer = engine.tokenizer
        import asyncio

        async def one(text: str, grammar: GrammarSpec | None) -> None:
            ids = tokenizer.encode_chat([{"role": "user", "content": text}])
            params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens,
                                    grammar=grammar, ignore_eos=grammar is None)
            async for _ in engine.generate(GenerateRequest(tuple(ids), params)):
                pass

        async def batch(grammar: GrammarSpec | None) -> None:
            await asyncio.gather(*(one(f"Invent a person from {s}.", grammar)
                                   for s in SUBJECTS[: args.batch]))

        asyncio.run(batch(spec))  # warm-up: compiles the schema, fills the cache
        masks.clear()
        steps.clear()
        asyncio.run(batch(spec))
        full = [s for rows, s in masks if rows == args.batch]
        constrained_steps = list(steps)
        steps.clear()
        asyncio.run(batch(None))
        plain_steps = list(steps)
    finally:
        setattr(penalties, "mask_logits", original)  # noqa: B010
        engine.shutdown()
    mask_ms = 1000 * sum(full) / max(1, len(full))
    step_ms = 1000 * sum(plain_steps) / max(1, len(plain_steps))
    constrained_ms = 1000 * sum(constrained_steps) / max(1, len(constrained_steps))
    result = {"batch": args.batch, "threads": torch.get_num_threads(),
              "mask_ms": round(mask_ms, 3), "masked_steps": len(full),
              "decode_step_ms": round(step_ms, 2), "plain_steps": len(plain_steps),
              "constrained_step_ms": round(constrained_ms, 2),
              "mask_share_of_step": round(mask_ms / step_ms, 4) if step_ms else None}
    print(f"batch {args.batch}, {result['threads']} threads: mask {mask_ms:.3f} ms per step "
          f"({len(full)} steps with every row masked); decode step {step_ms:.2f} ms "
          f"unconstrained, {constrained_ms:.2f} ms constrained; mask = "
          f"{100 * mask_ms / step_ms:.1f}% of an unconstrained step")
    return result


def main(args: argparse.Namespace) -> int:
    results = count_valid(args) if args.url else mask_cost(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0
