"""What the client benchmarks send: prompts of a given token length, conversations, datasets.

Everything here is deterministic given a seed and independent of timing: each
conversation draws its prompts from its own generator (seeded by the run seed
and its index), and arrival gaps come from a generator of their own, so two runs
with the same seed send the same prompts in the same pattern whatever the
server's speed. Only the answers, which come from the server, can differ.

Prompts come in two styles:
- ``tokens``: lists of random token ids, sent as ids; lengths are exact.
- ``text``: random words, sized with a client-side codec (UTF-8 bytes by
  default, which is what the byte-level tokenizer of dummy models counts; or a
  ``tokenizer.json``), so lengths are exact for that tokenizer and close for
  others (the server's ``prompt_tokens`` is what the reports use).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Prompt = list[int] | str

# Stream ids mixed into the run seed, so each consumer of randomness has its own generator.
_ARRIVALS_STREAM = 1 << 30
_WARMUP_STREAM = (1 << 30) + 1
_CONTEXT_STREAM = 1 << 29


class WorkloadError(ValueError):
    """A workload that cannot be built as asked (bad sizes, unreadable dataset)."""


class PromptStyle(str, Enum):
    TOKENS = "tokens"
    TEXT = "text"


class ArrivalDistribution(str, Enum):
    POISSON = "poisson"
    UNIFORM = "uniform"


# ------------------------------------------------------------------------ codecs
class TokenCodec(Protocol):
    """Client-side token counting: text <-> ids without special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteCodec:
    """UTF-8 bytes as token ids 0-255: the count the byte-level tokenizer makes."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class JsonTokenizerCodec:
    """A Hugging Face ``tokenizer.json`` (file or model directory), through ``tokenizers``."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise WorkloadError(f"--tokenizer: {file} is not a tokenizer.json file")
        self._tokenizer = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))


def load_codec(path: str | None) -> TokenCodec:
    return ByteCodec() if path is None or path == "byte" else JsonTokenizerCodec(path)


# ------------------------------------------------------------------------ prompts
# Plain words for text prompts; short and ASCII so byte counts stay predictable.
_WORDS = (
    "river", "stone", "cloud", "lamp", "orange", "window", "garden", "silver", "paper", "engine",
    "forest", "bridge", "candle", "winter", "market", "pencil", "harbor", "meadow", "planet",
    "rocket", "violin", "thunder", "basket", "mirror", "castle", "desert", "island", "jacket",
    "kettle", "ladder", "marble", "needle", "oyster", "pillow", "quartz", "saddle", "tunnel",
    "umbrella", "velvet", "wagon", "yellow", "zebra", "anchor", "bottle", "copper", "dragon",
    "feather", "ginger", "hammer", "insect", "jungle", "kitten", "lemon", "magnet", "nickel",
    "orchid", "parrot", "rabbit", "salmon", "tomato", "valley", "walnut", "blanket", "canyon",
    "dolphin", "falcon", "glacier", "horizon", "lantern", "mountain", "notebook", "ocean",
    "pepper", "quiet", "ribbon", "summer", "teacup", "village", "whistle", "shadow", "morning",
    "evening", "number", "letter", "question", "answer", "story", "simple", "gentle", "bright",
    "narrow", "heavy", "silent", "rapid", "humble", "clever", "honest",
)


@dataclass(frozen=True)
class PromptMaker:
    """Makes prompts of a token length in one style and appends conversation parts."""

    style: PromptStyle = PromptStyle.TOKENS
    codec: TokenCodec = field(default_factory=ByteCodec)
    # Token ids are drawn from [low, high): 0-255 are valid ids for every tokenizer we serve.
    token_low: int = 0
    token_high: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.token_low < self.token_high:
            raise WorkloadError(
                f"token id range [{self.token_low}, {self.token_high}) is empty or negative"
            )

    def make(self, rng: np.random.Generator, num_tokens: int) -> Prompt:
        if num_tokens < 0:
            raise WorkloadError(f"a prompt length must be >= 0, got {num_tokens}")
        if self.style is PromptStyle.TOKENS:
            ids = rng.integers(self.token_low, self.token_high, size=num_tokens)
            return [int(i) for i in ids]
        return self._words(rng, num_tokens)

    def _words(self, rng: np.random.Generator, num_tokens: int) -> str:
        if num_tokens == 0:
            return ""
        # Each word is preceded by a space, so pieces concatenate into clean text.
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < num_tokens:
            batch = rng.integers(0, len(_WORDS), size=max(8, num_tokens // 2))
            words.extend(" " + _WORDS[int(i)] for i in batch)
            ids = self.codec.encode("".join(words))
        text = "".join(words)
        # Cut to exactly num_tokens ids; a cut inside a multi-byte or merged token can
        # re-encode one token longer or shorter, which is fine for a benchmark prompt.
        return self.codec.decode(ids[:num_tokens]) if len(ids) > num_tokens else text

    def answer(self, text: str, output_ids: Sequence[int] | None) -> Prompt:
        """A server's answer as a conversation part: its ids when known, else its text."""
        if self.style is PromptStyle.TEXT:
            return text
        if output_ids is not None:
            return list(output_ids)
        return self.codec.encode(text)

    def count(self, prompt: Prompt) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.codec.encode(prompt))


def concat(parts: Sequence[Prompt]) -> Prompt:
    """Join conversation parts of one style (all id lists, or all strings)."""
    lists = [p for p in parts if isinstance(p, list)]
    if len(lists) == len(parts):
        return [t for p in lists for t in p]
    texts = [p for p in parts if isinstance(p, str)]
    if len(texts) == len(parts):
        return "".join(texts)
    raise WorkloadError("cannot join token-id and text prompt parts")


# ------------------------------------------------------------------------ sessions
@dataclass(frozen=True)
class RequestPlan:
    """One request of a session: its prompt, output length and where it belongs."""

    session: int
    round: int
    prompt: Prompt
    max_tokens: int
    group: int = 0  # long-context: the shared context the question is about


class Session:
    """A client's sequence of requests; each round is sent after the previous one finished.

    ``parts[0]`` is the first prompt and ``parts[r]`` the new question of round r;
    the prompt of round r is the previous round's prompt, its answer, then
    ``parts[r]``.
    """

    def __init__(
        self, index: int, parts: Sequence[Prompt], max_tokens: int, maker: PromptMaker,
        group: int = 0,
    ) -> None:
        if not parts:
            raise WorkloadError("a session needs at least one prompt")
        self.index = index
        self.parts = list(parts)
        self.max_tokens = max_tokens
        self.maker = maker
        self.group = group
        self.round = 0
        self._history: Prompt = parts[0]

    @property
    def num_rounds(self) -> int:
        return len(self.parts)

    @property
    def done(self) -> bool:
        return self.round >= self.num_rounds

    def next_request(self) -> RequestPlan:
        if self.done:
            raise WorkloadError(f"session {self.index} has no rounds left")
        return RequestPlan(self.index, self.round, self._history, self.max_tokens, self.group)

    def record_answer(self, text: str, output_ids: Sequence[int] | None) -> None:
        """Close the current round with the server's answer; build the next prompt."""
        self.round += 1
        if not self.done:
            answer = self.maker.answer(text, output_ids)
            self._history = concat([self._history, answer, self.parts[self.round]])


def multiturn_sessions(
    num_clients: int, num_rounds: int, request_length: int, sub_question_length: int,
    output_length: int, maker: PromptMaker, seed: int,
) -> list[Session]:
    """``num_clients`` conversations of ``num_rounds`` rounds each."""
    if num_clients < 1 or num_rounds < 1:
        raise WorkloadError("--num-clients and --num-rounds must be >= 1")
    if request_length < 1 or output_length < 1 or sub_question_length < 0:
        raise WorkloadError(
            "--request-length and --output-length must be >= 1, --sub-question-length >= 0"
        )
    sessions = []
    for client in range(num_clients):
        rng = np.random.default_rng([seed, client])
        parts = [maker.make(rng, request_length)]
        parts += [maker.make(rng, sub_question_length) for _ in range(num_rounds - 1)]
        sessions.append(Session(client, parts, output_length, maker))
    return sessions


def working_set_tokens(
    num_clients: int, num_rounds: int, request_length: int, sub_question_length: int,
    output_length: int,
) -> int:
    """KV tokens of every conversation's final context: what a perfect cache would hold."""
    final = request_length + (num_rounds - 1) * (output_length + sub_question_length)
    return num_clients * (final + output_length)


def warmup_prompts(maker: PromptMaker, count: int, length: int, seed: int) -> list[Prompt]:
    """Prompts unrelated to the workload (their own random stream) for warm-up requests."""
    rng = np.random.default_rng([seed, _WARMUP_STREAM])
    return [maker.make(rng, length) for _ in range(count)]


# ------------------------------------------------------------------------ arrivals
def arrival_gaps(
    distribution: ArrivalDistribution, rate: float, seed: int
) -> Iterator[float]:
    """Seconds between successive request sends for ``rate`` requests per second.

    Poisson arrivals have exponential gaps of mean 1/rate; uniform ones a fixed
    1/rate. An infinite rate sends everything at once (only --max-inflight limits).
    """
    if not rate > 0:
        raise WorkloadError(f"--request-rate must be > 0, got {rate}")
    rng = np.random.default_rng([seed, _ARRIVALS_STREAM])
    while True:
        if math.isinf(rate):
            yield 0.0
        elif distribution is ArrivalDistribution.POISSON:
            yield float(rng.exponential(1.0 / rate))
        else:
            yield 1.0 / rate


# ------------------------------------------------------------------------ long context
@dataclass(frozen=True)
class LongContextQuery:
    context: int  # index into LongContextDataset.contexts
    question: Prompt
    # Output tokens to ask for; None = the benchmark's --output-length.
    max_tokens: int | None = None


@dataclass(frozen=True)
class LongContextDataset:
    contexts: list[Prompt]
    queries: list[LongContextQuery]

    def sessions(
        self, maker: PromptMaker, output_length: int, interleave: bool = True,
        num_queries: int | None = None, seed: int = 0,
    ) -> list[Session]:
        """One single-round session per question (context then question).

        ``interleave`` orders questions round-robin over their contexts (context
        0, 1, 2, ..., 0, 1, ...), so consecutive requests need different prefixes
        and a small device pool must swap them; otherwise a seeded shuffle.
        """
        queries = list(self.queries)
        if interleave:
            by_context: dict[int, list[LongContextQuery]] = {}
            for q in queries:
                by_context.setdefault(q.context, []).append(q)
            queues = [by_context[c] for c in sorted(by_context)]
            queries = []
            for i in range(max((len(q) for q in queues), default=0)):
                queries += [q[i] for q in queues if i < len(q)]
        else:
            order = np.random.default_rng([seed, _CONTEXT_STREAM]).permutation(len(queries))
            queries = [queries[int(i)] for i in order]
        if num_queries is not None:
            queries = queries[:num_queries]
        return [
            Session(
                i, [concat([self.contexts[q.context], q.question])],
                q.max_tokens if q.max_tokens is not None else output_length, maker,
                group=q.context,
            )
            for i, q in enumerate(queries)
        ]


def synthetic_long_context(
    num_contexts: int, context_length: int, questions_per_context: int, question_length: int,
    maker: PromptMaker, seed: int,
) -> LongContextDataset:
    """``num_contexts`` random documents with ``questions_per_context`` questions each."""
    if num_contexts < 1 or questions_per_context < 1:
        raise WorkloadError("--num-contexts and --questions-per-context must be >= 1")
    if context_length < 1 or question_length < 1:
        raise WorkloadError("--context-length and --question-length must be >= 1")
    contexts: list[Prompt] = []
    queries: list[LongContextQuery] = []
    for c in range(num_contexts):
        rng = np.random.default_rng([seed, _CONTEXT_STREAM, c])
        contexts.append(maker.make(rng, context_length))
        queries += [
            LongContextQuery(c, maker.make(rng, question_length))
            for _ in range(questions_per_context)
        ]
    return LongContextDataset(contexts, queries)


def load_long_context(path: str | Path, maker: PromptMaker) -> LongContextDataset:
    """Read a long-context dataset; prompts are text, or token ids in ``tokens`` style.

    Two layouts are understood:
    - ``{"contexts": [...] or {id: text}, "queries": [{"context": id, "question": ...,
      "reference_answer": ...}]}`` (the answer, when present, sets the output length
      in tokens of the client codec);
    - LooGLE records: a list (or JSON lines) of ``{"input": document, "qa_pairs": [...]}``
      where each pair has ``Q``/``A`` (``qa_pairs`` may be the string form of that list,
      as the published files have it).
    """
    file = Path(path)
    try:
        raw = file.read_text(encoding="utf-8")
    except OSError as error:
        raise WorkloadError(f"cannot read dataset {file}: {error}") from error
    try:
        data: Any = json.loads(raw)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{file} is neither JSON nor JSON lines: {error}") from error
    if isinstance(data, dict) and "contexts" in data and "queries" in data:
        texts, queries = _contexts_and_queries(data)
    elif isinstance(data, list):
        texts, queries = _loogle_records(data)
    else:
        raise WorkloadError(
            f"{file}: expected {{'contexts', 'queries'}} or a list of LooGLE records"
        )
    if not queries:
        raise WorkloadError(f"{file} has no questions")
    return LongContextDataset(
        [_as_prompt(t, maker) for t in texts],
        [
            # A line break keeps the question from running into the document's last word.
            LongContextQuery(c, _as_prompt("\n" + q, maker), _answer_tokens(a, maker))
            for c, q, a in queries
        ],
    )


_Query = tuple[int, str, str | None]


def _contexts_and_queries(data: dict[str, Any]) -> tuple[list[str], list[_Query]]:
    raw_contexts = data["contexts"]
    if isinstance(raw_contexts, dict):
        ids = list(raw_contexts)
        texts = [str(raw_contexts[k]) for k in ids]
    elif isinstance(raw_contexts, list):
        ids = list(range(len(raw_contexts)))
        texts = [str(t) for t in raw_contexts]
    else:
        raise WorkloadError("'contexts' must be a list or an object")
    # JSON object keys are strings; queries may name them as numbers.
    index = {str(k): i for i, k in enumerate(ids)}
    queries: list[_Query] = []
    for n, query in enumerate(data["queries"]):
        if not isinstance(query, dict) or "question" not in query or "context" not in query:
            raise WorkloadError(f"query {n} needs 'context' and 'question'")
        key = str(query["context"])
        if key not in index:
            raise WorkloadError(f"query {n} names an unknown context {query['context']!r}")
        answer = query.get("reference_answer", query.get("answer"))
        question = str(query["question"])
        queries.append((index[key], question, None if answer is None else str(answer)))
    return texts, queries


def _loogle_records(records: list[Any]) -> tuple[list[str], list[_Query]]:
    texts: list[str] = []
    queries: list[_Query] = []
    for n, record in enumerate(records):
        if not isinstance(record, dict) or "input" not in record:
            raise WorkloadError(f"record {n} has no 'input' document")
        pairs = record.get("qa_pairs", [])
        if isinstance(pairs, str):
            # The published files store the list as Python literal text.
            try:
                pairs = ast.literal_eval(pairs) if pairs.strip() not in ("", "none") else []
            except (ValueError, SyntaxError) as error:
                raise WorkloadError(f"record {n}: unreadable qa_pairs: {error}") from error
        if not isinstance(pairs, list):
            raise WorkloadError(f"record {n}: qa_pairs must be a list")
        texts.append(str(record["input"]))
        for pair in pairs:
            if isinstance(pair, dict) and "Q" in pair:
                answer = pair.get("A")
                queries.append(
                    (len(texts) - 1, str(pair["Q"]), None if answer is None else str(answer))
                )
        if not pairs and "question" in record:  # records with a single question
            queries.append((len(texts) - 1, str(record["question"]), record.get("answer")))
    return texts, queries


def _as_prompt(text: str, maker: PromptMaker) -> Prompt:
    if maker.style is PromptStyle.TOKENS:
        return maker.codec.encode(text)
    return text


def _answer_tokens(answer: str | None, maker: PromptMaker) -> int | None:
    if answer is None:
        return None
    return max(1, len(maker.codec.encode(answer)))
