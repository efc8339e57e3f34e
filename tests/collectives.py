"""What each rank does in test_group (spawned children import this module, not the test)."""

from __future__ import annotations

from typing import Any

import torch

from hicache.distributed.group import TPGroup


def exercise_collectives(tp: TPGroup, widths: tuple[int, ...]) -> dict[str, Any]:
    """Every collective of TPGroup once, on values that say which rank made them."""
    rank = tp.rank
    summed = tp.all_reduce_sum(torch.full((2, 3), float(rank + 1)))
    # Rows [2, 4], rank r's width widths[r], entries 100 * r + column.
    mine = torch.arange(widths[rank], dtype=torch.float32).add(100 * rank).expand(2, -1)
    gathered = tp.all_gather_last_dim(mine.contiguous(), widths)
    equal = tp.all_gather_last_dim(torch.full((1, 2), float(rank)))
    obj = tp.broadcast_object({"from": rank, "batch": [1, 2, 3]} if rank == 0 else None)
    from_last = tp.broadcast_object(f"rank {rank}", src=tp.size - 1)
    everyone = tp.all_gather_object({"rank": rank, "word": "x" * rank})  # uneven sizes
    tp.barrier()
    return {"summed": summed, "gathered": gathered, "equal": equal, "obj": obj,
            "from_last": from_last, "everyone": everyone}


def fail_on_rank_one(tp: TPGroup, _: Any) -> None:
    if tp.rank == 1:
        raise RuntimeError("rank one fails on purpose")
    # Rank 0 waits in a collective its peer never joins: it must time out, not hang.
    tp.all_reduce_sum(torch.zeros(1))
