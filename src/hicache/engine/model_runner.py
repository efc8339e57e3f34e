"""The model runner: between the scheduler and the model, it owns the step's tensors.

The scheduler decides what each running request computes this step (its plan);
the runner keeps the request -> page table current and turns the plan into a
``ForwardBatch`` with host work O(batch + new tokens): a decode contributes its
last token, its position and one slot, looked up in its page list, and never
its whole context. Then it runs the model.

The scheduler tells it when a request's pages change (``admit``, ``grow``,
``replace``, ``release``); the runner stages those rows of the table and flushes
them in one write before the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicache.engine.decode_graphs import DecodeGraphs
from hicache.engine.page_table import ReqToPageTable
from hicache.engine.request import Req
from hicache.memory.allocator import PageIds
from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.model import CausalLM


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: DevicePool, max_running_requests: int, max_context_len: int
    ) -> None:
        self.model = model
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        # One page beyond the context: a request may hold a page its last token will not fill.
        max_pages = -(-max_context_len // self.page_size) + 1
        self.max_context_len = max_context_len
        # One row more than requests: recorded decode steps keep one for their padding.
        self.table = ReqToPageTable(max_running_requests + 1, max_pages, self.device)
        self.decode_graphs: DecodeGraphs | None = None  # see record_decode_graphs

    def record_decode_graphs(self, max_batch: int, *, capture: bool = True) -> str | None:
        """Record the decode step for batches of up to ``max_batch`` sequences (CUDA
        graphs; ``capture=False``: the same static-buffer step run eagerly, for tests)
        and use it from now on. Returns why not, and records nothing, if a replay does
        not agree with the eager step."""
        graphs = DecodeGraphs(
            self.model, self.pool, self.table, max_batch, self.max_context_len, capture=capture
        )
        problem = graphs.self_check()
        if problem is None:
            self.decode_graphs = graphs
        return problem

    # ------------------------------------------------------ page bookkeeping
    def admit(self, req: Req) -> None:
        """Give ``req`` a row holding its pages (its cached prefix, maybe none)."""
        req.row = self.table.acquire()
        self.table.write(req.row, 0, req.pages)

    def grow(self, req: Req, new: PageIds) -> None:
        """Append ``new`` pages to ``req``'s context."""
        assert req.row is not None
        start = len(req.pages)
        req.add_pages(new)
        self.table.write(req.row, start, new)

    def replace(self, req: Req, pages: PageIds) -> None:
        """``req``'s pages become ``pages`` (the tree swapped in its own copies)."""
        assert req.row is not None
        self.table.replace(req.row, req.pages, pages)
        req.pages = pages

    def release(self, req: Req) -> None:
        if req.row is not None:
            self.table.release(req.row)
            req.row = None

    # ------------------------------------------------------------- the step
    def forward(
        self,
        plan: Sequence[tuple[Req, int]],
        logits_from: Sequence[int] | None,
        wait_layer: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """Compute ``n`` new tokens of each (request, n) in ``plan``; the model's logits
        (rows as ``ForwardBatch.logit_rows``)."""
        graphs = self.decode_graphs
        if (
            graphs is not None and logits_from is None and graphs.fits(len(plan))
            and all(n == 1 for _, n in plan)
        ):
            self.table.flush()
            positions = [req.num_computed for req, _ in plan]
            ids = [req.token_at(start) for (req, _), start in zip(plan, positions, strict=True)]
            rows: list[int] = [req.row for req, _ in plan]  # type: ignore[misc]
            return graphs.replay(ids, positions, rows, wait_layer)
        return self.model.forward(self.build_batch(plan, logits_from), self.pool,
                                  wait_layer=wait_layer)

    def build_batch(
        self, plan: Sequence[tuple[Req, int]], logits_from: Sequence[int] | None = None
    ) -> ForwardBatch:
        # Per request: a few appends. A decode's one token is the last of its context;
        # the slots of every new token are looked up in the page table on the device.
        rows: list[int] = [req.row for req, _ in plan]  # type: ignore[misc]  # running: a row
        extend_lens = [n for _, n in plan]
        if len(extend_lens) == sum(extend_lens):  # decodes only: one token each
            positions = [req.num_computed for req, _ in plan]
            ids = [req.token_at(start) for (req, _), start in zip(plan, positions, strict=True)]
            seq_lens = [start + 1 for start in positions]
        else:
            ids, positions, seq_lens = [], [], []
            for req, n in plan:
                start = req.num_computed
                ids.extend(req.token_slice(start, start + n))
                positions.extend(range(start, start + n))
                seq_lens.append(start + n)
        self.table.flush()
        device = self.device
        host = torch.tensor([ids, positions], dtype=torch.int64)
        rows_host = torch.tensor(rows, dtype=torch.int32)
        if device.type != "cpu":
            host = host.to(device, non_blocking=True)
            rows_host = rows_host.to(device, non_blocking=True)
        token_pos = host[1]
        token_rows = rows_host
        if len(ids) != len(rows):
            token_rows = torch.repeat_interleave(
                rows_host, torch.tensor(extend_lens, device=device)
            )
        ps = self.page_size
        pages = self.table.table[token_rows.long(), token_pos // ps]
        return ForwardBatch(
            input_ids=host[0], positions=token_pos, out_slots=pages.long() * ps + token_pos % ps,
            extend_lens=tuple(extend_lens), seq_lens=tuple(seq_lens),
            page_table=self.table.table, table_rows=rows_host, page_size=ps,
            logits_from=tuple(logits_from) if logits_from is not None else None,
        )
