"""``hicache bench decode`` steps the model over real pages, as the engine does, and they
compute what the same contexts give through one-token pages."""

from __future__ import annotations

import torch

from hicache.bench.decode import _decode_batch, _prefill
from hicache.model.batch import ForwardBatch
from tests.model_scenarios import dummy_model, new_pool, small_qwen3_style


def test_decode_batch_walks_real_pages_and_equals_one_token_pages() -> None:
    model = dummy_model(small_qwen3_style())
    page_size, pages_each, batch, context = 4, 6, 3, 17
    pool = new_pool(model, num_pages=batch * pages_each, page_size=page_size)
    slots = _prefill(model, pool, batch, context, pages_each, page_size)
    pages = torch.stack([s[::page_size] // page_size for s in slots]).to(torch.int32)
    paged = _decode_batch(pages, context + 1, page_size)
    assert paged.page_size == page_size and paged.seq_lens == (context + 1,) * batch
    assert paged.out_slots.tolist() == [int(s[context]) for s in slots]
    with torch.inference_mode():
        got = model.forward(paged, pool)
        # The same step again (it rewrites the same K/V) through one-token pages.
        flat = ForwardBatch.from_sequences([[3]] * batch, [s[: context + 1] for s in slots])
        expected = model.forward(flat, pool)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
