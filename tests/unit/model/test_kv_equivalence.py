"""KV-cache equivalence on CPU (fp32): however a prompt's KV got into the pool, logits agree.

One-step prefill == cached prefix (page-aligned and not) + rest == chunked
prefill == token-by-token decode; a mixed batch gives each sequence the
logits it gets alone; ``wait_layer`` gates every layer's pool reads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache.memory.device_pool import DevicePool
from hicache.model.batch import BatchError, ForwardBatch
from hicache.model.errors import ModelConfigError
from hicache.model.model import CausalLM
from hicache.model.presets import get_preset
from tests.model_scenarios import (
    SlotAllocator,
    dummy_model,
    mixed_batch_vs_alone,
    new_pool,
    random_tokens,
    run_in_steps,
    small_qwen3_style,
)

TINY = get_preset("tiny")
QWEN3_STYLE = small_qwen3_style(num_layers=3)
CONFIGS = {"tiny-llama": TINY, "qwen3-style": QWEN3_STYLE}
# fp32; different step shapes change GEMM blocking and attention kernels, so not bitwise.
TOL = {"atol": 5e-6, "rtol": 1e-6}
PAGE_SIZE = 4
PROMPT_LEN = 23


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest) -> CausalLM:
    return dummy_model(CONFIGS[request.param])


def _steps_logits(model: CausalLM, steps: list[int], seed: int = 0) -> torch.Tensor:
    tokens = random_tokens(PROMPT_LEN, model.config.vocab_size, seed=7)
    pool = new_pool(model, page_size=PAGE_SIZE)
    slots = SlotAllocator(pool, seed).slots(PROMPT_LEN)
    return run_in_steps(model, pool, tokens, slots, steps)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param([8, PROMPT_LEN - 8], id="cached-prefix-page-aligned"),
        pytest.param([5, PROMPT_LEN - 5], id="cached-prefix-unaligned"),
        pytest.param([3, 7, 1, PROMPT_LEN - 11], id="chunked"),
        pytest.param([1] * PROMPT_LEN, id="token-by-token"),
        pytest.param([6] + [1] * (PROMPT_LEN - 6), id="prefill-then-decode"),
    ],
)
def test_steps_equal_one_step_prefill(model: CausalLM, steps: list[int]) -> None:
    reference = _steps_logits(model, [PROMPT_LEN])
    got = _steps_logits(model, steps, seed=1)  # other pages, too
    torch.testing.assert_close(got, reference, **TOL)


def test_pool_holds_the_same_kv_whatever_the_steps(model: CausalLM) -> None:
    tokens = random_tokens(PROMPT_LEN, model.config.vocab_size, seed=3)
    kvs = []
    for steps in ([PROMPT_LEN], [5, PROMPT_LEN - 5], [1] * PROMPT_LEN):
        pool = new_pool(model, page_size=PAGE_SIZE)
        slots = SlotAllocator(pool, seed=len(steps)).slots(PROMPT_LEN)
        run_in_steps(model, pool, tokens, slots, steps)
        kvs.append(pool.kv[:, :, slots])  # [layers, 2, tokens, kv_heads, head_dim]
    torch.testing.assert_close(kvs[1], kvs[0], **TOL)
    torch.testing.assert_close(kvs[2], kvs[0], **TOL)


def test_outputs_are_finite_varied_and_deterministic(model: CausalLM) -> None:
    first = _steps_logits(model, [5, PROMPT_LEN - 5])
    again = _steps_logits(model, [5, PROMPT_LEN - 5])
    assert torch.equal(first, again)  # same batch, same pool state: bitwise
    assert first.dtype == torch.float32 and torch.isfinite(first).all()
    assert first.std(dim=-1).min() > 0.01  # logits vary across the vocabulary
    assert len(set(first.argmax(dim=-1).tolist())) > 1  # and from token to token


def test_mixed_batch_gives_each_sequence_its_own_logits(model: CausalLM) -> None:
    batched, alone = mixed_batch_vs_alone(
        model, prompt_lens=(13, 6), decode_contexts=[2, 17, 9, 30]
    )
    assert batched.shape == (6, model.config.vocab_size)
    torch.testing.assert_close(batched, alone, **TOL)


def test_decode_only_batch(model: CausalLM) -> None:
    batched, alone = mixed_batch_vs_alone(model, prompt_lens=(1, 1), decode_contexts=[5, 2, 12])
    torch.testing.assert_close(batched, alone, **TOL)


def test_last_token_logits_are_rows_of_all_logits(model: CausalLM) -> None:
    pool = new_pool(model, page_size=PAGE_SIZE)
    alloc = SlotAllocator(pool)
    seqs = [random_tokens(n, model.config.vocab_size, seed=n) for n in (7, 3, 11)]
    contexts = [alloc.slots(len(s)) for s in seqs]
    before = pool.flat.clone()
    last = model(ForwardBatch.from_sequences(seqs, contexts), pool)
    pool.flat.copy_(before)
    every = model(ForwardBatch.from_sequences(seqs, contexts, return_all_logits=True), pool)
    assert every.shape == (21, model.config.vocab_size)
    torch.testing.assert_close(last, every[[6, 9, 20]], **TOL)


def test_wait_layer_gates_each_layer_before_it_reads_the_pool(model: CausalLM) -> None:
    """The prefix's K/V of layer l reach the pool only inside wait_layer(l), as a load
    from host memory would: any read before the wait would see zeros."""
    tokens = random_tokens(PROMPT_LEN, model.config.vocab_size, seed=5)
    pool = new_pool(model, page_size=PAGE_SIZE)
    slots = SlotAllocator(pool).slots(PROMPT_LEN)
    reference = run_in_steps(model, pool, tokens, slots, [PROMPT_LEN])[9:]
    loaded = pool.kv.clone()
    pool.flat.zero_()
    calls: list[int] = []

    def wait_layer(layer: int) -> None:
        calls.append(layer)
        pool.kv[layer].copy_(loaded[layer])

    batch = ForwardBatch.from_sequences([tokens[9:]], [slots], return_all_logits=True)
    got = model(batch, pool, wait_layer=wait_layer)
    assert calls == list(range(model.config.num_layers))
    torch.testing.assert_close(got, reference, **TOL)


def test_pool_must_fit_the_model() -> None:
    model = dummy_model(TINY)
    other = dataclasses.replace(TINY, num_kv_heads=1, num_heads=2, head_dim=32)
    pool = DevicePool(other.kv_geometry(), 4, 4)
    batch = ForwardBatch.from_sequences([[1, 2]], [[0, 1]])
    with pytest.raises(ModelConfigError, match="geometry"):
        model(batch, pool)


def test_positions_past_the_model_limit_are_refused() -> None:
    short = dataclasses.replace(TINY, max_position_embeddings=8)
    model = dummy_model(short)
    pool = new_pool(model)
    with pytest.raises(BatchError, match="max_position_embeddings"):
        model(ForwardBatch.from_sequences([[1] * 9], [list(range(9))]), pool)


def test_batch_checks_its_fields() -> None:
    ids = torch.tensor([1, 2, 3])
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)  # one-token pages: slots = ids
    row = torch.zeros(1, dtype=torch.int32)

    def batch_of(positions: torch.Tensor = ids - 1, extend: int = 3, total: int = 3,
                 page_table: torch.Tensor = table, rows: torch.Tensor = row,
                 page_size: int = 1) -> ForwardBatch:
        return ForwardBatch(ids, positions, ids, extend_lens=(extend,), seq_lens=(total,),
                            page_table=page_table, table_rows=rows, page_size=page_size)

    with pytest.raises(BatchError, match="extend_len"):
        batch_of(total=2)
    with pytest.raises(BatchError, match="does not fit the page table"):
        batch_of(total=5)
    batch_of(total=5, page_size=2)  # 3 pages of 2 tokens hold 5
    with pytest.raises(BatchError, match="positions"):
        batch_of(positions=ids[:2])
    with pytest.raises(BatchError, match="table_rows"):
        batch_of(rows=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(BatchError, match="int32"):
        batch_of(page_table=table.long())
    wrong_positions = batch_of(positions=torch.tensor([0, 1, 3]))
    with pytest.raises(BatchError, match=r"positions must be 0\.\.2"):
        wrong_positions.validate()
    with pytest.raises(BatchError, match="out_slots must be the last slots"):
        batch_of(page_table=torch.tensor([[1, 2, 4]], dtype=torch.int32)).validate()
    batch = ForwardBatch.from_sequences([[5, 6], [7]], [[10, 11, 12], [20, 21]])
    batch.validate()
    assert batch.prefix_lens == (1, 1)
    assert batch.positions.tolist() == [1, 2, 1]
    assert batch.out_slots.tolist() == [11, 12, 21]


def test_context_slots_follow_the_page_table() -> None:
    # Two sequences in rows 2 and 0 of a table of 4-token pages; only their rows are read.
    table = torch.tensor([[7, 3, 0], [9, 9, 9], [5, 1, 0]], dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([5, 6, 8]),
        out_slots=torch.tensor([5, 6, 0]), extend_lens=(2, 1), seq_lens=(7, 9),
        page_table=table, table_rows=torch.tensor([2, 0], dtype=torch.int32), page_size=4,
    )
    batch.validate()
    expected = [20, 21, 22, 23, 4, 5, 6, 28, 29, 30, 31, 12, 13, 14, 15, 0]
    assert batch.context_slots.tolist() == expected
    assert batch.sequence_pages.tolist() == [[5, 1, 0], [7, 3, 0]]
