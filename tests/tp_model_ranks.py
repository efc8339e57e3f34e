"""What a rank computes in the tensor-parallel model tests, and the single-rank reference.

A ``Case`` names a model (a checkpoint dir, or a config with dummy weights) and how to
run it; ``run_case`` builds it for a rank (``tp``) or alone (``tp`` None) and runs the
same greedy scenario through the paged pool: a prefill of a prompt's first tokens, a
mixed prefill (the rest of that prompt on its cached prefix, two cold prompts), then
decode steps of all three together, each feeding back its greedy token, and a last
decode of sequence 0 alone (one row: the one-row weights' path). Spawned ranks
import this module (not the test, which imports transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.distributed.group import TPGroup
from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.config import ModelConfig
from hicache.model.errors import ModelConfigError
from hicache.model.loader import load_model
from hicache.model.model import CausalLM
from hicache.model.weights import init_dummy_weights
from tests.model_scenarios import SlotAllocator, random_tokens

PROMPT_LENS = (13, 7, 21)
CACHED_PREFIX = 5  # tokens of prompt 0 computed by an earlier step
DECODE_STEPS = 5
PAGE_SIZE = 4
DUMMY_SEED = 3


@dataclass(frozen=True)
class Case:
    name: str
    model_path: str | None = None  # a model dir (float32); None: dummy weights of ``config``
    config: ModelConfig | None = None
    prepack: bool = False
    compile: bool = False
    keep_weights: bool = True  # return the rank's weights (small models only)


@dataclass
class CaseResult:
    logits: list[torch.Tensor]  # per step: float32 [rows, vocab]
    tokens: list[list[int]]  # per sequence: its greedy tokens
    # HF name -> (the rank's part, the split dim or None, its start), when kept.
    weights: dict[str, tuple[torch.Tensor, int | None, int]] = field(default_factory=dict)
    kv_heads: tuple[int, int] = (0, 0)  # the rank's pool's, the whole model's
    # A rank that holds part of the KV heads, given a pool of them all: its error.
    whole_pool_error: str | None = None


def build(
    case: Case, tp: TPGroup | None
) -> tuple[CausalLM, dict[str, tuple[torch.Tensor, int | None, int]] | None]:
    """The case's model, and (``keep_weights``) the rank's weight shards as loaded: taken
    before packing, which may release the plain weights."""
    if case.model_path is not None:
        model = load_model(case.model_path, "auto", None, "float32", "cpu", tp=tp).model
    else:
        assert case.config is not None
        model = CausalLM(case.config, "cpu", tp=tp)
        init_dummy_weights(model, seed=DUMMY_SEED, std=0.05)
    weights = None
    if case.keep_weights:
        weights = {
            name: (s.target.detach().clone(), s.dim, s.start)
            for name, s in model.hf_shards().items()
        }
    if case.prepack:
        assert model.prepack_weights()
    if case.compile:
        model.compile_blocks()
    return model, weights


def run_case(case: Case, tp: TPGroup | None) -> CaseResult:
    model, weights = build(case, tp)
    result = greedy_scenario(model)
    whole = model.config.kv_geometry(model.dtype)
    result.kv_heads = (model.kv_geometry().num_kv_heads, whole.num_kv_heads)
    if model.kv_geometry() != whole:
        try:
            model(ForwardBatch.from_sequences([[1]], [[0]]), DevicePool(whole, 2, PAGE_SIZE))
        except ModelConfigError as e:
            result.whole_pool_error = str(e)
    if weights is not None:
        result.weights = weights
    return result


def run_cases(tp: TPGroup, cases: list[Case]) -> dict[str, CaseResult]:
    """A rank's results of every case (the target of ``run_ranks``)."""
    return {case.name: run_case(case, tp) for case in cases}


@torch.inference_mode()
def greedy_scenario(model: CausalLM) -> CaseResult:
    vocab = model.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=10 + i) for i, n in enumerate(PROMPT_LENS)]
    pool = DevicePool(model.kv_geometry(), 64, PAGE_SIZE, model.device)
    alloc = SlotAllocator(pool, seed=1)
    slots = [alloc.slots(len(p) + DECODE_STEPS + 1) for p in prompts]

    def step(new: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Sequences 0.. len(new) - 1 add ``new`` to reach ``context_lens`` tokens."""
        contexts = [s[:n] for s, n in zip(slots, context_lens, strict=False)]
        batch = ForwardBatch.from_sequences(new, contexts, return_all_logits=True)
        return model(batch, pool)

    logits = [step([prompts[0][:CACHED_PREFIX]], [CACHED_PREFIX])]
    # Mixed prefill: seq 0 continues its cached prefix, seqs 1 and 2 start cold.
    prefill = step(
        [prompts[0][CACHED_PREFIX:], prompts[1], prompts[2]], [len(p) for p in prompts]
    )
    logits.append(prefill)
    ends = torch.tensor([len(prompts[0]) - CACHED_PREFIX, len(prompts[1]), len(prompts[2])])
    last_rows = ends.cumsum(0) - 1
    tokens = [[int(t)] for t in prefill[last_rows].argmax(-1)]
    for _ in range(DECODE_STEPS - 1):
        lens = [len(p) + len(t) for p, t in zip(prompts, tokens, strict=True)]
        out = step([t[-1:] for t in tokens], lens)  # [3, vocab]
        logits.append(out)
        for seq, token in zip(tokens, out.argmax(-1), strict=True):
            seq.append(int(token))
    # One row: prepacked models multiply it by their column-major weights instead.
    alone = step([tokens[0][-1:]], [len(prompts[0]) + len(tokens[0])])
    logits.append(alone)
    tokens[0].append(int(alone[0].argmax()))
    return CaseResult(logits, tokens)
