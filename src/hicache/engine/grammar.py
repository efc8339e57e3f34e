"""Grammar-constrained decoding: a request's output forced to match a JSON schema, any JSON
object, a regex or an EBNF grammar, through xgrammar (what SGLang and vLLM use; it runs on
the CPU).

- ``GrammarSpec`` (in hicache.engine.api) is what a request asks (kind and text); it
  is part of its ``SamplingParams``, so it crosses to the engine process and to tensor-parallel
  followers as plain data.
- ``Grammars`` compiles specs for one tokenizer (the model's vocabulary size, which
  may exceed the tokenizer's: padding ids are never allowed) and keeps what it
  compiled, by spec. Compiling runs where a request is submitted (the server's worker
  thread, the engine process's intake), never on the scheduler thread of rank 0; a
  spec that does not compile is a ``RequestError`` (a 400) there, before anything is
  queued.
- ``GrammarState`` is one request's (one sample's) matcher: which tokens may come next
  given the output so far. It advances by exactly the tokens appended to the output, so
  its state is a function of ``output_ids`` alone: a retracted request keeps its output
  and its matcher, and a cached prefix (the prompt) changes nothing.
- ``mask_logits`` sets to -inf, in one pass over the batch, every token the grammar of
  each constrained row forbids. End-of-sequence ids are allowed only where the grammar
  may end; once it has ended the only allowed tokens are those.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hicache.engine.api import GRAMMAR_KINDS, GrammarSpec, RequestError

if TYPE_CHECKING:
    from hicache.tokenizer.base import Tokenizer

# Compiled grammars kept per Grammars (one per engine): a schema compiles in milliseconds,
# but agent frameworks send the same few schemas over and over.
MAX_CACHED_GRAMMARS = 256


class Grammars:
    """Compiles ``GrammarSpec``s for one tokenizer and model vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built at the first use
        self._compiled: dict[GrammarSpec, Any] = {}

    def _get_compiler(self) -> Any:
        # Building the tokenizer's info walks its whole vocabulary (0.7 s for SmolLM2's
        # 49k tokens): only for an engine that is asked for a grammar.
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(self._tokenizer, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``); RequestError
        when it does not compile."""
        with self._lock:
            cached = self._compiled.get(spec)
            if cached is not None:
                return cached
            compiler = self._get_compiler()
            try:
                if spec.kind == "json_schema":
                    compiled = compiler.compile_json_schema(spec.text, any_whitespace=False)
                elif spec.kind == "json_object":
                    compiled = compiler.compile_builtin_json_grammar()
                elif spec.kind == "regex":
                    compiled = compiler.compile_regex(spec.text)
                elif spec.kind == "ebnf":
                    compiled = compiler.compile_grammar(spec.text)
                elif spec.kind == "tool_calls":
                    compiled = compiler.compile_grammar(tool_calls_grammar(spec.text))
                else:
                    raise RequestError(
                        f"unknown grammar kind {spec.kind!r}; one of {GRAMMAR_KINDS}"
                    )
            except (RuntimeError, ValueError, KeyError) as error:  # parse errors
                raise RequestError(f"invalid {spec.kind}: {_short(error)}") from error
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = compiled
            return compiled

    def state(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(self.compile(spec), self.vocab_size)


# Hermes-style tool calls, as hicache.server.tool_parser reads them back.
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


def tool_calls_grammar(text: str) -> Any:
    """The grammar of ``max_calls`` tool calls at most (one at least), each a JSON object
    valid against ``call_schema`` between the tags, separated by a newline."""
    import xgrammar as xgr

    description = json.loads(text)
    max_calls = int(description["max_calls"])
    call = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_OPEN)}"),
        xgr.Grammar.from_json_schema(json.dumps(description["call_schema"]),
                                     any_whitespace=False),
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_CLOSE)}"),
    )
    separator = xgr.Grammar.from_ebnf('root ::= "\\n"')
    calls = call
    for _ in range(max_calls - 1):  # one call, or one, a newline and the rest
        calls = xgr.Grammar.union(call, xgr.Grammar.concat(call, separator, calls))
    return calls


def _short(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 2)[-1] if text.count(": ") >= 2 else text
    return text.splitlines()[0] if text else type(error).__name__


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of ``tokenizer``: every token's bytes, its vocabulary type and the
    ids that end generation. ``vocab_size`` is the model's (its logits' width)."""
    import xgrammar as xgr

    from hicache.tokenizer.byte_level import ByteTokenizer
    from hicache.tokenizer.hf import HFTokenizer

    stop_ids = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        return xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
    if isinstance(tokenizer, ByteTokenizer):
        # Tokens 0-255 are bytes; the specials (and any padding id past them) are empty,
        # which xgrammar takes as special: never part of a match.
        vocab: list[bytes] = [bytes([i]) for i in range(256)]
        vocab += [b""] * (tokenizer.vocab_size - 256)
        return xgr.TokenizerInfo(
            vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
            stop_token_ids=stop_ids,
        )
    raise RequestError(f"grammars are not supported with {type(tokenizer).__name__}")


class GrammarState:
    """One sample's matcher over its output tokens."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        """Advance by ``token``, the output's next; False when the grammar forbids it (the
        matcher is then unchanged)."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """Whether the grammar accepted an end-of-sequence token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def mask_logits(logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]
                ) -> None:
    """Set to -inf, in place, in rows ``rows`` of ``logits`` [n, vocab], the tokens each
    row's grammar ``states[i]`` forbids next. One bitmask for the rows, one application."""
    import xgrammar as xgr

    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, state in enumerate(states):
        state.fill(bitmask, i)
    if len(rows) == len(logits) and list(rows) == list(range(len(logits))):
        target = logits
    else:
        target = logits[torch.tensor(list(rows), dtype=torch.int64, device=logits.device)]
    # xgrammar masks on the CPU with a native kernel (and on a GPU with its own).
    xgr.apply_token_bitmask_inplace(target, bitmask.to(target.device), vocab_size=vocab)
    if target is not logits:
        logits[torch.tensor(list(rows), dtype=torch.int64, device=logits.device)] = target
